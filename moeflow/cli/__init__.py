"""Thin command-line entry points that map flags to configs."""
