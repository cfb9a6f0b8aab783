"""Checks of command-line flags, shared by the commands: parsed flags -> a config dataclass,
argparse types for numbers with a range, and the paths and devices a command will use.

Every check runs before the command does any work and fails with a ``UsageError``
(``moeflow.cli.errors``: one line, exit 2) or, for the argparse types, argparse's own one-line
``argument --flag: ...``. ``float`` flags need nothing: ``moeflow.cli.main``'s parser refuses
``nan`` and ``inf`` for every one of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from moeflow.cli.errors import UsageError

__all__ = ["config_from_flags", "name_flags", "finite_float", "int_at_least", "float_at_least", "check_output_dir",
           "check_output_file", "check_input_file", "check_device"]

ConfigT = TypeVar("ConfigT")


def config_from_flags(
    config_cls: type[ConfigT], args: argparse.Namespace, prog: str = "moeflow bench", **overrides: Any
) -> ConfigT | None:
    """Build ``config_cls`` from the parsed flags named like its fields (``overrides`` win);
    None, after printing one line ``prog: error: argument --flag: ...``, when the config rejects
    a value (the caller then exits with status 2, as argparse does for a bad flag). The flags
    are named through ``args.flag_names`` (destination -> option, set by ``main``): the
    config's message names its fields, the user typed the flags."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    try:
        return config_cls(**{**flags, **overrides})
    except (ValueError, TypeError) as err:
        print(f"{prog}: error: {name_flags(str(err), getattr(args, 'flag_names', {}))}", file=sys.stderr)
        return None


def name_flags(message: str, flag_names: dict[str, str]) -> str:
    """A library's message for the command line: ``message`` prefixed with ``argument --flag: ``
    for the first flag whose destination it names as a whole word (``lr`` in ``lr must be > 0``;
    ``--no-x`` switches excepted); unchanged when it names none or already names a flag."""
    if re.search(r"(?<![\w-])--\w", message):
        return message
    found = []
    for dest, flag in flag_names.items():
        hit = None if flag.startswith("--no-") else re.search(rf"(?<![\w-]){re.escape(dest)}(?!\w)", message)
        if hit is not None:
            found.append((hit.start(), flag))
    return f"argument {min(found)[1]}: {message}" if found else message


# ---- argparse types: a bad value becomes argparse's one line ``argument --flag: <message>``

def finite_float(text: str) -> float:
    """A finite float (``type=float`` of every moeflow flag: ``main`` registers it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def float_at_least(minimum: float, *, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float >= ``minimum`` (> with ``strict``)."""

    def parse(text: str) -> float:
        value = finite_float(text)
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum}, got {value}")
        return value

    parse.__name__ = f"float {'>' if strict else '>='} {minimum}"
    return parse


# ---- paths and devices, checked before any work

def _writable_dir(flag: str, path: Path, what: Path) -> None:
    """``path`` (an existing directory) lets this process create files, as the OS says; where
    ``what`` is still to be made in it, also tried (a file created and removed: ``os.access``
    says yes to root on /proc). A directory that already holds the output is not written to:
    a refused or finished command leaves it exactly as it was."""
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {what}: cannot write in {path} (permission denied)")
    if path == what:
        return
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".moeflow-probe-")
    except OSError as err:
        raise UsageError(f"{flag} {what}: cannot write in {path} ({err.strerror or err})") from None
    os.close(fd)
    os.unlink(probe)


def check_output_dir(flag: str, path: Path | str) -> Path:
    """``path`` is, or can be created as, a directory this process writes in: it is not a file,
    and its nearest existing ancestor is a writable directory (nothing is created here)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is a file, not a directory")
    _writable_dir(flag, existing, path)
    return path


def check_output_file(flag: str, path: Path | str) -> Path:
    """``path`` can be written as a file: not a directory, in a directory that is or can be made."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: cannot write it (permission denied)")
    check_output_dir(flag, path.parent)
    return path


def check_input_file(flag: str, path: Path | str) -> Path:
    """``path`` is an existing, readable file."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not path.is_file():
        raise UsageError(f"{flag} {path}: not a file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{flag} {path}: cannot read it (permission denied)")
    return path


def check_device(flag: str, value: str) -> str:
    """``value`` names a device this machine has: ``cpu``, or ``cuda``/``cuda:N`` with CUDA
    available and N below the device count."""
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{flag} {value!r}: not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return value
    if device.type != "cuda":
        raise UsageError(f"{flag} {value!r}: moeflow runs on cpu or cuda[:N], not {device.type}")
    if not torch.cuda.is_available():
        raise UsageError(f"{flag} {value!r}: CUDA is not available on this machine (torch {torch.__version__}"
                         f"{'' if torch.version.cuda else ', built without CUDA'})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"{flag} {value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return value
