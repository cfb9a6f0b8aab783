"""Checks of command-line flags, shared by the commands: parsed flags -> a config dataclass,
argparse types for numbers with a range, and the paths and devices a command will use.

The device: ``--device`` defaults to CUDA where torch sees it, else the CPU (``choose_device``,
which also gives each rank of a torchrun job its own GPU, ``cuda:LOCAL_RANK``, and refuses
more ranks on a machine than it has GPUs).

Every check runs before the command does any work and fails with a ``UsageError``
(``moeflow.cli.errors``: one line, exit 2) or, for the argparse types, argparse's own one-line
``argument --flag: ...``. ``float`` flags need nothing: ``moeflow.cli.main``'s parser refuses
``nan`` and ``inf`` for every one of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from moeflow.cli.errors import UsageError

__all__ = ["config_from_flags", "name_flags", "finite_float", "int_at_least", "float_at_least", "check_output_dir",
           "check_output_file", "check_input_file", "check_device", "DEVICE_HELP", "DeviceChoice", "default_device",
           "choose_device", "env_threads", "threads_help",
           "apply_config_file", "config_toml"]

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
    ``--no-x`` switches excepted); unchanged when it names none or already names a flag. Words
    inside a path (``/runs/steps/checkpoints``: any run of characters with a ``/``) do not
    count: a directory is not a flag. A library message names the setting at fault first
    (``num_experts=4 changes the model ...; ... overwrite=True to start over``): the first
    destination is the flag the user gave, a later one a remedy."""
    if re.search(r"(?<![\w-])--\w", message):
        return message
    paths = [m.span() for m in re.finditer(r"[^\s'\"]*/[^\s'\"]*", message)]
    found = []
    for dest, flag in flag_names.items():
        if flag.startswith("--no-"):
            continue
        for hit in re.finditer(rf"(?<![\w-]){re.escape(dest)}(?!\w)", message):
            if not any(a <= hit.start() < b for a, b in paths):
                found.append((hit.start(), flag))
                break
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


DEVICE_HELP = ("cpu, cuda or cuda:N (default: cuda when torch.cuda.is_available(), else cpu; the command's first "
               "line says which and why)")


def default_device() -> str:
    """The device a command runs on when ``--device`` is not given: ``"cuda"`` where torch sees a
    CUDA device (``torch.cuda.is_available()``), else ``"cpu"``. A machine with a GPU is used
    as one; the first line of the command says so (``DeviceChoice.line``)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class DeviceChoice:
    """The device a command runs on, as torch takes it (``cpu``, ``cuda:N``; ``cuda`` in the
    process that starts ``--nproc`` ranks, each of which gets ``cuda:LOCAL_RANK``), and
    ``line``, what the command prints first: ``device: cuda:0 (default: CUDA is available)``."""

    device: str
    line: str


def choose_device(flag: str, given: str | None, *, ranks: int | None = None, local_rank: int | None = None,
                  ranks_from: str = "--nproc") -> DeviceChoice:
    """The device of a command: ``given`` (the flag's value, checked as ``check_device`` does)
    or, when None, ``default_device()``; ``UsageError`` naming the flag for one this machine
    does not have.

    ``ranks``: the processes of a torchrun job on this machine (``--nproc N``, or torchrun's
    ``LOCAL_WORLD_SIZE`` in a rank; None: one process, no torchrun). Each rank takes one GPU,
    ``cuda:LOCAL_RANK`` (``moeflow.parallel.init_distributed`` makes it the rank's current
    device), so ``cuda`` names this rank's own (``local_rank``; None in the process that starts
    the ranks), ``cuda:N`` is refused unless it is the only rank's own (two ranks on one GPU
    would each expect it to be theirs; NCCL refuses a GPU shared by ranks), and more ranks than
    GPUs are refused naming both numbers (``ranks_from``: how the ranks were asked for, e.g.
    ``--nproc 2``), before any rank starts, not as rank 1's ``invalid device ordinal``."""
    import torch

    value = default_device() if given is None else given
    why = f"{flag} {given}" if given is not None else (
        "default: CUDA is available" if value == "cuda" else "default: CUDA is not available")
    check_device(flag, value)
    device = torch.device(value)
    if device.type == "cpu":
        return DeviceChoice("cpu", f"device: cpu ({why})")
    if ranks is None:
        index = 0 if device.index is None else device.index
        return DeviceChoice(f"cuda:{index}", f"device: cuda:{index} ({why})")
    if device.index is not None and (ranks > 1 or device.index != 0):
        raise UsageError(f"{flag} {value}: under torchrun ({ranks_from}) each rank uses its own GPU, cuda:LOCAL_RANK "
                         f"(rank r of a machine on cuda:r), so one index cannot name every rank's; give {flag} cuda")
    count = torch.cuda.device_count()
    if ranks > count:
        how = f"{flag} {value}" if given is not None else f"{flag} {value}, the default where CUDA is available"
        raise UsageError(f"{ranks_from} runs {ranks} ranks on this machine, one GPU each with {how}, but it has "
                         f"{count} CUDA device(s): run at most {count} rank(s) per machine, or give {flag} cpu")
    if local_rank is not None:
        return DeviceChoice(f"cuda:{local_rank}", f"device: cuda:{local_rank} on this rank, cuda:LOCAL_RANK on each "
                            f"of the {ranks} rank(s) of this machine ({why})")
    shown = "cuda:0" if ranks == 1 else f"cuda:0..cuda:{ranks - 1}"
    return DeviceChoice("cuda", f"device: {shown}, one GPU per rank ({why})")


# ---- threads: the environment's choice first

def env_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a thread count, when it is set to a positive integer (None when it
    is unset, empty or anything else, e.g. OpenMP's nested list ``4,2``: then the command's own
    default applies). A user who set it (a busy machine, a job scheduler) meant it: a command's
    default must not override it."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def threads_help(fallback: int, what: str = "torch threads per process") -> str:
    """``--threads`` help text naming the default in effect now: ``$OMP_NUM_THREADS`` when set,
    else ``fallback``."""
    env, raw = env_threads(), os.environ.get("OMP_NUM_THREADS")
    if env is not None:
        now = f"in effect now: {env}, from OMP_NUM_THREADS"
    elif raw:
        now = f"in effect now: {fallback}; OMP_NUM_THREADS={raw!r} is not a positive integer and is ignored"
    else:
        now = f"in effect now: {fallback}, OMP_NUM_THREADS is not set"
    return f"{what} (default: OMP_NUM_THREADS when set, else {fallback}; {now})"


# ---- a config file: the flags' destinations as TOML keys, the command line wins

def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations ``argv`` sets (parsed again with a namespace that already holds every
    destination: argparse then leaves the ones not given as they are)."""
    # a repeatable flag's action appends to a copy of what the namespace holds: its placeholder
    # must be a list (argparse copies it, so the copy is told apart); any other flag's, an object
    unset = {a.dest: [] if isinstance(a, argparse._AppendAction) else object()
             for a in parser._actions if a.dest != "help"}
    ns = argparse.Namespace(**unset)
    parser.parse_args(argv, namespace=ns)
    return {k for k, v in vars(ns).items() if k not in unset or v is not unset[k]}


class _One:
    """One value of a repeatable flag: its type and choices, checked as a plain flag's."""

    def __init__(self, action: argparse.Action) -> None:
        self.type, self.choices = action.type, action.choices


def _config_value(parser: argparse.ArgumentParser, flag: str, action: Any, value: Any) -> Any:
    """A TOML value for ``action``, checked as the flag's own text would be (its type and choices)."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise UsageError(f"{flag}: must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):  # a repeatable flag (--data A --data B): a list
        values = value if isinstance(value, list) else [value]
        return [_config_value(parser, flag, _One(action), v) for v in values]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # a list of works for a comma-separated flag
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UsageError(f"{flag}: must be a string or a number, got {value!r}")
    text = str(value)
    try:
        convert = parser._registry_get("type", action.type, action.type)  # type=float: moeflow's finite float
        parsed = convert(text) if convert is not None else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
        raise UsageError(f"{flag}: {err or f'invalid value {value!r}'}") from None
    if action.choices is not None and parsed not in action.choices:
        raise UsageError(f"{flag}: must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return parsed


def apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace, path: Path | str,
                      argv: list[str], *, skip: tuple[str, ...] = ()) -> None:
    """Set ``args`` from the TOML file ``path`` (keys: the flags' destinations, e.g. ``steps``,
    ``num_experts``, ``warmup_steps``) where ``argv`` (the command's flags) did not set them;
    every key and value is checked as its flag would be, before any work (``UsageError``
    naming the file and the key). ``skip``: destinations a file may not set."""
    import tomllib

    path = check_input_file("--config", path)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"--config {path}: not a TOML file ({err})") from None
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "debug", *skip)}
    given = _given(parser, argv)
    for key, value in table.items():
        if key not in actions:
            flags = {s.lstrip("-"): d for d, a in actions.items() for s in a.option_strings}
            hint = f" (for --{key.lstrip('-')} write {flags[key.lstrip('-')]})" if key.lstrip("-") in flags else ""
            raise UsageError(f"--config {path}: unknown key {key!r}{hint}; the keys are the flags' destinations: "
                             f"{', '.join(sorted(actions))}")
        flag = next(s for s in actions[key].option_strings if s.startswith("--"))
        parsed = _config_value(parser, f"--config {path}: {key} ({flag})", actions[key], value)
        if key not in given:
            setattr(args, key, parsed)


def config_toml(args: argparse.Namespace, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> str:
    """The flags' values in ``args`` as a TOML file ``apply_config_file`` reads back (unset
    flags, whose value is None, are left out: TOML has no null)."""
    lines = []
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in ("help", "debug", *skip) or getattr(args, dest, None) is None:
            continue
        value = getattr(args, dest)
        if isinstance(action, argparse._AppendAction):  # a repeatable flag: a TOML array of its values
            if value:
                lines.append(f"{dest} = [{', '.join(json.dumps(str(v)) for v in value)}]")
            continue
        if isinstance(value, tuple):
            value = ",".join(value)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
        lines.append(f"{dest} = {text}")
    return "\n".join(lines) + "\n"
