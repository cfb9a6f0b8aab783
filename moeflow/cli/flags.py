"""Parsed command-line flags -> the frozen config dataclass of a command."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, TypeVar

__all__ = ["config_from_flags"]

ConfigT = TypeVar("ConfigT")


def config_from_flags(
    config_cls: type[ConfigT], args: argparse.Namespace, prog: str = "moeflow bench", **overrides: Any
) -> ConfigT | None:
    """Build ``config_cls`` from the parsed flags named like its fields (``overrides`` win);
    None, after printing ``prog: error: ...``, when the config rejects a value (the caller then
    exits with status 2, as argparse does for a bad flag)."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    try:
        return config_cls(**{**flags, **overrides})
    except (ValueError, TypeError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return None
