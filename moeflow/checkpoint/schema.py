"""What a valid checkpoint ``index.json`` is: ``check_index`` checks a parsed index against the
schema (every required field, its type and range, every tensor key, and every expert of every
expert parameter in some file) before anything uses it; every failure is a ``CheckpointError``
naming the file and the field. ``moeflow.checkpoint.format`` reads checkpoint directories
through it (and re-exports both)."""

from __future__ import annotations

import math
import re
from pathlib import PurePosixPath

import torch

__all__ = ["FORMAT", "CheckpointError", "check_index"]

FORMAT = "moeflow-checkpoint/1"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RNG_KEY = re.compile(r"^rng/rank(\d+)/[A-Za-z0-9_]+$")
_REQUIRED = ("step", "world_size", "experts", "files", "optimizer", "extra")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked (the message names file and mismatch)."""


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_error(where: str, field: str, value: object, want: str) -> CheckpointError:
    return CheckpointError(f"{where}: {field}={_show(value)} ({type(value).__name__}), expected {want}")


def _int(where: str, field: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _type_error(where, field, value, f"an int >= {low}")
    return value


def _typed(where: str, field: str, value: object, kind: type) -> object:
    """``value`` if it is a JSON object (``kind=dict``) or list (``kind=list``)."""
    if not isinstance(value, kind):
        raise _type_error(where, field, value, "a JSON object" if kind is dict else "a JSON list")
    return value


def _finite(where: str, field: str, value: object) -> None:
    """Every number inside ``value`` (hyper-parameters, extra) is finite: NaN and infinities
    parse as JSON extensions and would poison an optimizer silently."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _type_error(where, field, value, "a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(where, f"{field}[{k!r}]", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite(where, f"{field}[{i}]", v)


# ------------------------------------------------------------------ the index schema


def _check_key(where: str, field: str, key: str, experts: dict[str, int], world_size: int) -> None:
    """A tensor key the loaders can take apart: ``param/<n>[@g]``, ``buffer/<n>``,
    ``optim/<n>/<k>[@g]``, ``rng/rank<r>/<device>``, with ``g`` below the parameter's expert count
    and ``r`` below the world size; one ``@`` at most (``save_checkpoint`` refuses names holding
    one)."""
    kind, _, rest = key.partition("/")
    base, at, g = key.rpartition("@") if "@" in key else (key, "", "")
    if (kind not in ("param", "buffer", "optim", "rng") or not rest or "@" in base
            or (at and not (g.isascii() and g.isdigit()))):
        raise CheckpointError(f"{where}: {field} has key {key!r}, not one of param/<name>[@<expert>], "
                              "buffer/<name>, optim/<name>/<state>[@<expert>], rng/rank<r>/<device>")
    if kind == "rng":
        m = _RNG_KEY.match(key)
        if m is None or int(m.group(1)) >= world_size:
            raise CheckpointError(f"{where}: {field} has key {key!r}: not rng/rank<r>/<device> with r below "
                                  f"world_size={world_size}")
        return
    if kind == "optim" and "/" not in base.split("/", 1)[1]:
        raise CheckpointError(f"{where}: {field} has key {key!r}, expected optim/<name>/<state>")
    if at:
        name = base.split("/", 1)[1]
        name = name.rsplit("/", 1)[0] if kind == "optim" else name
        if kind == "buffer" or name not in experts or int(g) >= experts[name]:
            raise CheckpointError(f"{where}: {field} has key {key!r}, but 'experts' records "
                                  f"{experts.get(name, 'no')} experts for {name!r}")


def _check_files(where: str, files: object, experts: dict[str, int], world_size: int) -> None:
    seen_files: set[str] = set()
    seen_keys: dict[str, str] = {}
    if not _typed(where, "files", files, list):
        raise CheckpointError(f"{where}: files is empty (a checkpoint has at least one file)")
    for i, entry in enumerate(files):  # type: ignore[arg-type]
        at = f"files[{i}]"
        _typed(where, at, entry, dict)
        for field in ("file", "sha256", "bytes", "tensors"):
            if field not in entry:
                raise CheckpointError(f"{where}: {at} has no {field!r} field")
        name = entry["file"]
        if not isinstance(name, str) or name in (".", "..") or PurePosixPath(name).name != name or "\\" in name:
            raise CheckpointError(f"{where}: {at}.file={_show(name)} is not a plain file name inside the checkpoint "
                                  "directory (no directories, no absolute paths)")
        if not name.endswith(".safetensors"):
            raise CheckpointError(f"{where}: {at}.file={name!r} is not a .safetensors file (only safetensors are read)")
        if name in seen_files:
            raise CheckpointError(f"{where}: {at}.file={name!r} is listed twice")
        seen_files.add(name)
        if not isinstance(entry["sha256"], str) or not _SHA256.match(entry["sha256"]):
            raise _type_error(where, f"{at}.sha256", entry["sha256"], "64 lowercase hex digits")
        _int(where, f"{at}.bytes", entry["bytes"], 0)
        for key, meta in _typed(where, f"{at}.tensors", entry["tensors"], dict).items():
            field = f"{at}.tensors[{key!r}]"
            _check_key(where, f"{at}.tensors", key, experts, world_size)
            if key in seen_keys:
                raise CheckpointError(f"{where}: {key!r} is listed in both {seen_keys[key]} and {name}")
            seen_keys[key] = name
            _typed(where, field, meta, dict)
            shape, dtype = meta.get("shape"), meta.get("dtype")
            if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
                raise _type_error(where, f"{field}.shape", shape, "a list of non-negative ints")
            if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise _type_error(where, f"{field}.dtype", dtype, "a torch dtype name such as 'float32'")
    _check_every_expert(where, seen_keys, experts)


def _check_every_expert(where: str, keys: dict[str, str], experts: dict[str, int]) -> None:
    """Every expert ``0..E-1`` of every expert parameter is in some file: a checkpoint that
    lacks one (a save published without some rank's file) is refused as a whole, on every rank,
    instead of on the ranks that happen to hold the missing experts now."""
    found: dict[str, set[int]] = {name: set() for name in experts}
    for key in keys:
        if key.startswith("param/") and "@" in key:
            name, g = key[len("param/"):].rsplit("@", 1)
            if name in found:
                found[name].add(int(g))
    for name, E in experts.items():
        missing = sorted(set(range(E)) - found[name])
        if missing:
            raise CheckpointError(f"{where}: expert(s) {missing[:8]} of {name} (E={E}) are in none of its files: an "
                                  "incomplete checkpoint, never loaded")


def _check_optimizer(where: str, meta: object) -> None:
    if meta is None:
        return
    _typed(where, "optimizer", meta, dict)
    if "type" in meta and not isinstance(meta["type"], str):
        raise _type_error(where, "optimizer.type", meta["type"], "a class name")
    for field in ("param_groups", "scalars"):
        if field not in meta:
            raise CheckpointError(f"{where}: optimizer has no {field!r} field")
    for i, group in enumerate(_typed(where, "optimizer.param_groups", meta["param_groups"], list)):
        at = f"optimizer.param_groups[{i}]"
        _typed(where, at, group, dict)
        if "params" not in group or "hyper" not in group:
            raise CheckpointError(f"{where}: {at} needs 'params' and 'hyper'")
        for j, param in enumerate(_typed(where, f"{at}.params", group["params"], list)):
            if not isinstance(param, str):
                raise _type_error(where, f"{at}.params[{j}]", param, "a parameter name")
        _finite(where, f"{at}.hyper", _typed(where, f"{at}.hyper", group["hyper"], dict))
    for name, state in _typed(where, "optimizer.scalars", meta["scalars"], dict).items():
        _finite(where, f"optimizer.scalars[{name!r}]", _typed(where, f"optimizer.scalars[{name!r}]", state, dict))


def check_index(index: object, where: str) -> dict:
    """``index`` (parsed ``index.json``) checked against the schema; ``where`` names it in errors."""
    index = _typed(where, "the index", index, dict)
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{where}: format {_show(index.get('format'))}, expected {FORMAT!r}")
    missing = [field for field in _REQUIRED if field not in index]
    if missing:
        raise CheckpointError(f"{where}: required field {missing[0]!r} is missing")
    _int(where, "step", index["step"], 0)
    world_size = _int(where, "world_size", index["world_size"], 1)
    experts = _typed(where, "experts", index["experts"], dict)
    for name, E in experts.items():
        _int(where, f"experts[{name!r}]", E, 1)
    _check_files(where, index["files"], experts, world_size)
    _check_optimizer(where, index["optimizer"])
    _typed(where, "extra", index["extra"], dict)
    return index
