"""``moeflow`` command line: ``moeflow [--debug] bench|train|prepare-data|generate|infer|serve|train-vision|a2a-model|convert ...``.

This module builds the parser and dispatches; each command family lives in its own module
(``bench``, ``convert``, ``train``, ``generate``, ``infer``, ``serve``), which adds its subcommands with an
``add_*(sub)`` function that sets ``func``, the handler returning the exit status.

How a command fails (``moeflow.cli.errors``): one line ``moeflow <command>: error: ...`` on
stderr and a non-zero exit, never a traceback. A bad flag is argparse's (status 2, without the
usage block); no ``float`` flag takes ``nan`` or ``inf``; a handler raises ``UsageError``
(its status) or returns its status; ``OSError`` and ``ValueError`` (a file the command could not
use, a value a library function refused) print their message (status 1), anything else is a bug
and says so (``unexpected error``, status 1). ``--debug`` (anywhere on the command line) lets
the exception through, with its traceback. Output into a closed pipe (``moeflow convert
--info | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import os
import sys

from moeflow import __version__
from moeflow.cli.bench import add_a2a_model, add_bench
from moeflow.cli.convert import add_convert
from moeflow.cli.data import add_prepare_data
from moeflow.cli.errors import UsageError, error_line
from moeflow.cli.flags import finite_float
from moeflow.cli.generate import add_generate
from moeflow.cli.infer import add_infer
from moeflow.cli.serve import add_serve
from moeflow.cli.train import add_train
from moeflow.cli.train_vision import add_train_vision

__all__ = ["build_parser", "main"]

_DEBUG_HELP = "on an error, show the traceback instead of one line"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (``(default: 300)``), except where the help
    already states it, or the default says nothing (None: "not set"; switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower() or "%(default)" in text
                or action.default is None or isinstance(action.default, bool) or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    """moeflow's parser (the subcommands' too): ``type=float`` means a finite float, and a bad
    flag is one line ``prog: error: message`` (status 2). On the ranks of a torchrun job other
    than 0 it exits with status 2 quietly: every rank parses the same command line, and rank 0
    reports it once."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("type", float, finite_float)

    def error(self, message: str):  # type: ignore[no-untyped-def]
        if "LOCAL_WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0":
            self.exit(2)
        self.exit(2, f"{error_line(self.prog, message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moeflow", description="Mixture-of-Experts layers for PyTorch.")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"moeflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench(sub)
    add_a2a_model(sub)
    add_convert(sub)
    add_train(sub)
    add_prepare_data(sub)
    add_generate(sub)
    add_infer(sub)
    add_serve(sub)
    add_train_vision(sub)
    for command in sub.choices.values():  # `moeflow train ... --debug` too; SUPPRESS keeps the global one
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def _flag_names(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """Destination -> the option a user types (``num_experts`` -> ``--experts``) of ``command``."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: next((s for s in a.option_strings if s.startswith("--")), a.option_strings[0])
            for a in sub._actions if a.option_strings and a.dest not in ("help", "debug")}


def _quiet_stdout() -> None:
    """stdout's reader went away: point stdout at /dev/null so that the flush at exit does not
    raise again (the recipe of Python's signal docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (stdout captured in-process)
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # --help into a closed pipe
        _quiet_stdout()
        return 1
    at = argv.index(args.command)
    # the command line as given, from the command on (``moeflow train --nproc`` hands it on to its ranks)
    args.argv = argv[at:] + (["--debug"] if debug and "--debug" not in argv[at:] else [])
    args.flag_names = _flag_names(parser, args.command)
    prog = f"moeflow {args.command}"
    if debug:
        return int(args.func(args))
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return status
    except UsageError as err:
        print(error_line(prog, err), file=sys.stderr)
        return err.status
    except BrokenPipeError:
        _quiet_stdout()
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError) as err:
        print(error_line(prog, str(err) or type(err).__name__), file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - a bug: still one line, and the way to see more
        print(error_line(prog, f"unexpected {type(err).__name__}: {err} (a bug in moeflow: `moeflow --debug "
                                 f"{args.command} ...` shows the traceback; please report it)"), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
