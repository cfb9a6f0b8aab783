"""The on-disk format of a checkpoint directory, and the one place that reads and checks it.

Layout of one checkpoint (``<root>/step-00000123/``)::

    index.json                       format, step, world size at save, experts per parameter,
                                     every file with its sha256 and its tensors (shape, dtype),
                                     optimizer hyper-parameters, user ``extra`` (data position, ...)
    rank00000-of-00004.safetensors   the experts rank 0 held (global keys ``...@<g>``), plus the
    rank00001-of-00004.safetensors   dense tensors (rank 0 only) and each rank's RNG state

A checkpoint is complete once its ``step-*`` directory holds ``index.json``: the writer,
``moeflow.checkpoint.io``, renames the directory into place and then writes ``index.json`` into
it, last, so the index appears only when every file it lists is in place, even where a
directory rename is not atomic (network and object-store mounts copy file by file).
``.tmp-step-*`` directories and ``step-*`` directories without ``index.json`` are the remains of
interrupted saves (or copies): never read, and removed by the next save into the same root.

Everything that reads a checkpoint directory goes through here: ``read_index`` parses and
checks ``index.json``, ``_Reader`` opens the files it lists, verifying each file's size and
sha256 once, and reads only JSON and safetensors (no pickle). Every failure is a
``CheckpointError`` naming the file, key and mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moeflow.checkpoint.state import split_key

__all__ = [
    "FORMAT",
    "CheckpointError",
    "complete_checkpoints",
    "latest_checkpoint",
    "partial_checkpoints",
    "read_index",
    "describe_checkpoint",
]

FORMAT = "moeflow-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked (the message names file and mismatch)."""


def _step_dirs(root: Path, step: int) -> tuple[Path, Path]:
    """``(final, tmp)``: where checkpoint ``step`` lives under ``root``, and where it is written."""
    return root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"




def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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


# ------------------------------------------------------------------ reading and checking


def read_index(path: str | os.PathLike) -> dict:
    """The parsed ``index.json`` of a checkpoint directory (checked for format)."""
    path = Path(path)
    index_path = path / "index.json"
    if not index_path.exists():
        raise CheckpointError(f"{path}: no index.json (not a complete moeflow checkpoint)")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{index_path}: not valid JSON ({err})") from None
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path}: format {index.get('format')!r}, expected {FORMAT!r}")
    return index


class _Reader:
    """Opens the checkpoint's files lazily, verifying each file's checksum once.

    ``where`` maps every tensor key of the index to its file's index entry.
    """

    def __init__(self, path: Path, index: dict) -> None:
        self.path, self.index = path, index
        self.where: dict[str, dict] = {}
        for entry in index["files"]:
            for key in entry["tensors"]:
                self.where[key] = entry
        self.verified: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        entry = self.where[key]
        file = self.path / entry["file"]
        if entry["file"] not in self.verified:
            if not file.exists():
                raise CheckpointError(f"{file}: missing (listed in index.json)")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"{file}: {size} bytes, index.json says {entry['bytes']} (truncated or replaced)")
            digest = _sha256(file)
            if digest != entry["sha256"]:
                raise CheckpointError(f"{file}: sha256 {digest[:12]}... does not match index.json ({entry['sha256'][:12]}...): corrupted")
            self.verified.add(entry["file"])
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(key)
        except SafetensorError as err:
            raise CheckpointError(f"{file}: cannot read {key!r} ({err})") from None


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
