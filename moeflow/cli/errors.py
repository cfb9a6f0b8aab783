"""How a ``moeflow`` command fails: one line on stderr and a non-zero exit, never a traceback
for a user's mistake.

The pattern every command follows::

    from moeflow.cli.errors import UsageError

    if args.tokens < 0:
        raise UsageError(f"--tokens must be >= 0, got {args.tokens}")

``moeflow.cli.main.main`` catches it and prints ``moeflow <command>: error: <message>`` and
returns ``status`` (2, argparse's status for a bad flag; 1 for a failure at run time). Check
every argument before doing any work (see ``moeflow.cli.flags`` for shared checks of numbers,
paths and devices), so a refusal costs nothing and leaves no file behind. An error a library
function raises for a bad input (``ValueError``, ``TypeError``, ``CheckpointError``, ``OSError``)
is also printed as one line by ``main``; anything else is a bug, printed as one line marked
``unexpected error`` (``moeflow --debug ...`` shows the traceback of either).
"""

from __future__ import annotations

__all__ = ["UsageError", "error_line"]


class UsageError(Exception):
    """A command refused its arguments or could not do what they ask: ``main`` prints
    ``moeflow <command>: error: <message>`` (one line) and exits with ``status``."""

    def __init__(self, message: str, *, status: int = 2) -> None:
        if status == 0:
            raise ValueError("a UsageError must exit non-zero, got status=0")
        super().__init__(message)
        self.status = status


def error_line(prog: str, message: object) -> str:
    """``prog: error: message`` on one line (a multi-line message is joined with `` | ``)."""
    text = " | ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
    return f"{prog}: error: {text}"
