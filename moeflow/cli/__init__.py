"""Thin command-line entry points that map flags to configs (``main``: the parser and how a
command fails, ``errors``: ``UsageError``, ``flags``: shared checks of flags, paths and devices)."""
