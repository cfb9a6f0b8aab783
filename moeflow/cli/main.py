"""``moeflow`` command line: ``moeflow bench|train|generate|infer|train-vision|a2a-model|convert ...``.

This module builds the parser and dispatches; each command family lives in its own module
(``bench``, ``convert``, ``train``, ``generate``, ``infer``), which adds its subcommands with an
``add_*(sub)`` function that sets ``func``, the handler returning the exit status.
"""

from __future__ import annotations

import argparse
import os
import sys

from moeflow.cli.bench import add_a2a_model, add_bench
from moeflow.cli.convert import add_convert
from moeflow.cli.generate import add_generate
from moeflow.cli.infer import add_infer
from moeflow.cli.train import add_train, add_train_vision

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """On the ranks of a torchrun job other than 0 a bad flag exits with status 2 quietly: every
    rank parses the same command line, and rank 0 reports it once."""

    def error(self, message: str):  # type: ignore[no-untyped-def]
        if "LOCAL_WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0":
            self.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moeflow", description="Mixture-of-Experts layers for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench(sub)
    add_a2a_model(sub)
    add_convert(sub)
    add_train(sub)
    add_generate(sub)
    add_infer(sub)
    add_train_vision(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line as given (``moeflow train --nproc`` hands it on to its ranks)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
