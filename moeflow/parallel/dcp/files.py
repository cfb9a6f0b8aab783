"""A whole ``torch.distributed.checkpoint`` (DCP) directory read or written by one process,
without a model: what ``moeflow.checkpoint.dcp`` converts (the only package that touches
``torch.distributed`` is this one, so the converter comes through here).

``write_dcp_dir(path, state)`` saves a nested state dict as a one-process DCP checkpoint (each
tensor whole, in one file); ``read_dcp_dir(path)`` returns every entry of any DCP checkpoint,
whatever world size wrote it, nested as it was saved (dicts, and lists for integer keys). Both
run without ``init_process_group`` and, when a process group exists, without using it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["write_dcp_dir", "read_dcp_dir"]


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes a single process whenever it runs without a process group: here
    that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def write_dcp_dir(path: str | os.PathLike, state: dict) -> Path:
    """Save ``state`` (nested dicts of tensors and picklable values) as a DCP checkpoint at
    ``path``, from this process alone. Returns the path."""
    path = Path(path)
    if (path / ".metadata").exists():
        raise ValueError(f"{path} already holds a DCP checkpoint; refusing to overwrite it")
    with _one_process():
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    return path


def _put(root: dict, keys: tuple, value: object) -> None:
    node: dict | list = root
    for key, nxt in zip(keys[:-1], keys[1:]):
        empty: dict | list = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = empty
            node = node[key]
        else:
            node = node.setdefault(key, empty)
    if isinstance(node, list):
        node.extend([None] * (keys[-1] + 1 - len(node)))
    node[keys[-1]] = value


def read_dcp_dir(path: str | os.PathLike) -> dict:
    """Every entry of the DCP checkpoint at ``path``, nested as saved (tensors whole, on CPU)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path}: no .metadata (not a torch.distributed.checkpoint directory)")
    metadata = FileSystemReader(path).read_metadata()
    flat: dict[str, object] = {
        # one process converts the directory in host memory
        key: torch.empty(md.size, dtype=md.properties.dtype, device="cpu") if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }
    with _one_process():
        dcp.load(flat, storage_reader=FileSystemReader(path), no_dist=True)
    paths = metadata.planner_data or {}
    nested: dict = {}
    for key, value in flat.items():
        _put(nested, tuple(paths.get(key, (key,))), value)
    return nested
