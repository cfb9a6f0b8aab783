"""The on-disk format of a checkpoint directory, and the one place that reads and checks it.

Layout of one checkpoint (``<root>/step-00000123/``)::

    index.json                       format, step, world size at save, experts per parameter,
                                     every file with its sha256 and its tensors (shape, dtype),
                                     optimizer type and hyper-parameters, user ``extra``
    rank00000-of-00004.safetensors   the experts rank 0 held (global keys ``...@<g>``), plus the
    rank00001-of-00004.safetensors   dense tensors (rank 0 only) and each rank's RNG state

A checkpoint is complete once its ``step-*`` directory holds ``index.json``: the writer,
``moeflow.checkpoint.io``, renames the directory into place and then writes ``index.json`` into
it, last, so the index appears only when every file it lists is in place, even where a
directory rename is not atomic (network and object-store mounts copy file by file).
``.tmp-step-*`` directories and ``step-*`` directories without ``index.json`` are the remains of
interrupted saves (or copies): never read, and removed by the next save into the same root.

Everything that reads a checkpoint directory goes through here, and treats it as untrusted:
``read_index`` parses ``index.json`` and checks its schema (``moeflow.checkpoint.schema``:
every required field, its type and range, every tensor key, every expert present) before
anything uses it; ``_Reader`` opens only the files it lists,
each a plain file name that must resolve (symbolic links followed) inside the directory, and
verifies each file's size, sha256 and tensor list once; only JSON and safetensors are read
(nothing is unpickled). Every failure is a ``CheckpointError`` naming the file and the field or
mismatch, and a path that would leave the directory is refused before it is opened or stat'ed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import SafetensorError, safe_open

from moeflow.checkpoint.schema import FORMAT, CheckpointError, _show, check_index
from moeflow.checkpoint.state import split_key

__all__ = ["FORMAT", "CheckpointError", "check_index", "checkpoint_dir", "complete_checkpoints", "inside",
           "latest_checkpoint", "partial_checkpoints", "read_index", "read_json", "describe_checkpoint"]

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _step_dirs(root: Path, step: int) -> tuple[Path, Path]:
    """``(final, tmp)``: where checkpoint ``step`` lives under ``root``, and where it is written."""
    return root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------ untrusted paths and JSON


def inside(root: str | os.PathLike, name: object, what: str) -> Path:
    """``root/name`` with symbolic links resolved, refusing (``CheckpointError`` naming ``what``)
    a name that is not a non-empty relative path, has a ``..`` part, or resolves outside
    ``root``. Nothing is opened or stat'ed here except through resolving links, and the message
    never says where a link leads."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{what}: {_show(name)} is not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive or "\\" in name or ".." in parts:
        raise CheckpointError(f"{what}: {name!r} leaves the directory {root} (an absolute path or '..'); "
                              "only files inside it are read")
    base = Path(root).resolve()
    full = base.joinpath(*parts).resolve()
    if full != base and base not in full.parents:
        raise CheckpointError(f"{what}: {name!r} is or passes a symbolic link that leads outside {root}; "
                              "only files inside it are read")
    return full


def read_json(root: str | os.PathLike, name: str) -> object:
    """The parsed JSON file ``root/name`` (which must lie inside ``root``); ``CheckpointError``
    naming the file when it is missing, unreadable or not JSON."""
    shown = Path(root) / name
    path = inside(root, name, str(shown))
    if not path.is_file():
        raise CheckpointError(f"{shown}: missing (or not a regular file)")
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{shown}: not valid JSON ({err})") from None
    except OSError as err:
        raise CheckpointError(f"{shown}: cannot be read ({err.strerror or err})") from None


# ------------------------------------------------------------------ finding checkpoints


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoint directories under ``root``, oldest step first (none if ``root``
    does not exist)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "index.json").exists())


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def partial_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Leftovers of interrupted saves under ``root``, never loaded: every ``.tmp-step-*``
    directory, and every ``step-*`` directory without ``index.json`` (killed between the rename
    and the index, or half copied)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (
        p.name.startswith(".tmp-step-") or (_STEP_DIR.match(p.name) and not (p / "index.json").exists())))


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint that ``path`` names: ``path`` itself when it holds ``index.json``; for a
    root, its latest complete checkpoint, with a warning when a newer ``step-*`` directory
    without an index lies beside it (an interrupted save or a partial copy: never loaded). A
    ``step-*`` directory without an index is refused, never replaced by an older step."""
    path = Path(path)
    if (path / "index.json").exists():
        return path
    if _STEP_DIR.match(path.name) and path.is_dir():
        older = latest_checkpoint(path.parent)
        raise CheckpointError(f"{path}: no index.json: an incomplete checkpoint (a save that was interrupted or a "
                              "partial copy), never loaded" + (f"; the latest complete one is {older}" if older else ""))
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: no complete checkpoint here")
    newer = [p.name for p in partial_checkpoints(path) if _STEP_DIR.match(p.name) and p.name > latest.name]
    if newer:
        warnings.warn(f"{path}: loading {latest.name}, the latest complete checkpoint; {newer[-1]} has no "
                      "index.json (an interrupted save or a partial copy) and is never loaded", UserWarning,
                      stacklevel=3)
    return latest


# ------------------------------------------------------------------ reading and checking


def read_index(path: str | os.PathLike) -> dict:
    """The parsed ``index.json`` of a checkpoint directory, checked against the schema."""
    path = Path(path)
    if not (path / "index.json").exists() and not (path / "index.json").is_symlink():
        raise CheckpointError(f"{path}: no index.json (not a complete moeflow checkpoint)")
    return check_index(read_json(path, "index.json"), str(path / "index.json"))


# safetensors' header dtype codes of the dtypes checkpoints hold, as index.json names them
_HEADER_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                  "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class _Reader:
    """Opens the checkpoint's files lazily, verifying each file's size, checksum and tensor list
    once. ``where`` maps every tensor key of the index to its file's index entry; every file
    is checked to lie inside ``path`` before any is opened."""

    def __init__(self, path: Path, index: dict) -> None:
        self.path, self.index = path, index
        self.where: dict[str, dict] = {}
        self.files: dict[str, Path] = {}
        for i, entry in enumerate(index["files"]):
            self.files[entry["file"]] = inside(path, entry["file"], f"{path / 'index.json'}: files[{i}].file")
            for key in entry["tensors"]:
                self.where[key] = entry
        self.verified: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.where

    def _verify(self, entry: dict) -> None:
        file, shown = self.files[entry["file"]], self.path / entry["file"]
        if not file.is_file():
            raise CheckpointError(f"{shown}: missing (listed in index.json)" if not file.exists() else
                                  f"{shown}: not a regular file")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{shown}: {size} bytes, index.json says {entry['bytes']} (truncated or replaced)")
        digest = _sha256(file)
        if digest != entry["sha256"]:
            raise CheckpointError(f"{shown}: sha256 {digest[:12]}... does not match index.json ({entry['sha256'][:12]}...): corrupted")
        try:
            header = {}
            with safe_open(str(file), framework="pt") as f:
                for k in f.keys():
                    part = f.get_slice(k)
                    header[k] = (list(part.get_shape()), part.get_dtype())
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{shown}: not a readable safetensors file ({err})") from None
        keys, listed = set(header), set(entry["tensors"])
        if keys != listed:
            raise CheckpointError(f"{shown}: its tensors differ from index.json's (unlisted: {sorted(keys - listed)[:3]}, "
                                  f"absent: {sorted(listed - keys)[:3]})")
        for key in sorted(keys):  # the header's shapes and dtypes: what load_checkpoint's first pass checked
            (shape, code), meta = header[key], entry["tensors"][key]
            dtype = _HEADER_DTYPES.get(code, meta["dtype"])  # (a code not listed: get() compares the tensor read)
            if shape != meta["shape"] or dtype != meta["dtype"]:
                raise CheckpointError(f"{shown}: {key} is {dtype} {shape} in the file, index.json says "
                                      f"{meta['dtype']} {meta['shape']}")
        self.verified.add(entry["file"])

    def _entry(self, key: str) -> dict:
        """The index entry of ``key``'s file, verified (once)."""
        entry = self.where[key]
        if entry["file"] not in self.verified:
            self._verify(entry)
        return entry

    def meta(self, key: str) -> torch.Tensor:
        """A ``meta`` tensor of ``key``'s shape and dtype as ``index.json`` lists them (its file
        verified, its data not read): what ``load_checkpoint``'s checking pass loads."""
        listed = self._entry(key)["tensors"][key]
        return torch.empty(listed["shape"], dtype=getattr(torch, listed["dtype"]), device="meta")

    def get(self, key: str) -> torch.Tensor:
        entry = self._entry(key)
        shown = self.path / entry["file"]
        try:
            with safe_open(str(self.files[entry["file"]]), framework="pt") as f:
                value = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{shown}: cannot read {key!r} ({err})") from None
        meta = entry["tensors"][key]
        dtype = str(value.dtype).removeprefix("torch.")
        if list(value.shape) != meta["shape"] or dtype != meta["dtype"]:
            raise CheckpointError(f"{shown}: {key} is {dtype} {list(value.shape)} in the file, index.json says "
                                  f"{meta['dtype']} {meta['shape']}")
        return value


def describe_checkpoint(path: str | os.PathLike) -> str:
    """Human-readable summary: step, world size, files, and every tensor group with its shape."""
    path = Path(path)
    index = read_index(path)
    lines = [f"{path}: step {index['step']}, written by {index['world_size']} rank(s), format {index['format']}"]
    for entry in index["files"]:
        lines.append(f"  {entry['file']}: {len(entry['tensors'])} tensors, {entry['bytes']} bytes, sha256 {entry['sha256'][:12]}")
    groups: dict[str, dict] = {}
    for entry in index["files"]:
        for key, meta in entry["tensors"].items():
            base, g = split_key(key)
            info = groups.setdefault(base, {"shape": meta["shape"], "dtype": meta["dtype"], "experts": 0})
            if g is not None:
                info["experts"] += 1
    lines.append("  tensors:")
    for base in sorted(groups):
        info = groups[base]
        per = f" x {info['experts']} experts" if info["experts"] else ""
        lines.append(f"    {base}: {info['dtype']} {tuple(info['shape'])}{per}")
    if index["experts"]:
        lines.append("  MoE expert parameters: " + ", ".join(f"{k} (E={v})" for k, v in sorted(index["experts"].items())))
    if index["extra"]:
        lines.append(f"  extra: {json.dumps(index['extra'])}")
    return "\n".join(lines)
