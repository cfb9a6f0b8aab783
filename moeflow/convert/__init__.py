"""Conversion between moeflow's formats and other libraries' (``moeflow convert``): Hugging Face
Mixtral directories both ways (``mixtral``). Above ``models`` and ``checkpoint``, which it
uses."""
