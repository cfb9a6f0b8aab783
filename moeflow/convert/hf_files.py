"""Hugging Face model directories on disk: ``config.json`` and the safetensors weights, read as
untrusted input and written for transformers.

Reading opens only files inside the directory, through ``moeflow.checkpoint.format.inside``:
``config.json`` (``read_hf_config``), then the weights (``HFWeights``): one
``model.safetensors``, or the shards that ``model.safetensors.index.json`` lists (a JSON
object whose ``weight_map`` maps every tensor to a relative path inside the directory; an
absolute path, a ``..`` or a link leading out is refused before anything is opened). Every file's
header is read first (names, shapes, dtypes: a truncated or garbage file is a
``CheckpointError`` naming it; safetensors never unpickles), so the whole map is checked before
any tensor is; tensors are then read one at a time (``HFWeights.read``), never all at once.

Writing (``write_hf``): ``config.json`` and the weights, one ``model.safetensors`` or, past
``max_shard_size`` bytes, shards ``model-00001-of-0000N.safetensors`` with their index, as
``save_pretrained`` names them (the tensors of one group, e.g. one layer's experts, stay in one
shard, which may then exceed the size, as transformers lets a single large tensor). Weight files
an earlier export left in the directory are removed, so the index and the files agree.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moeflow.checkpoint.format import CheckpointError, inside, read_json

__all__ = ["HFWeights", "read_hf_config", "write_hf", "parse_size", "DEFAULT_SHARD_SIZE", "present"]

_SHARD_INDEX = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DEFAULT_SHARD_SIZE = 5 * 10**9
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
           "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def present(path: Path, name: str) -> bool:
    return (path / name).exists() or (path / name).is_symlink()  # a link leading out is refused, not skipped


def read_hf_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` dict of an HF model directory."""
    path = Path(path)
    if not present(path, "config.json"):
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
    config = read_json(path, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'}: a JSON {type(config).__name__}, expected an object")
    return config


def _weight_files(path: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read and the shard index's ``weight_map`` (None: one file)."""
    if present(path, _SHARD_INDEX):
        index = read_json(path, _SHARD_INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            found = "none" if not isinstance(index, dict) or "weight_map" not in index else repr(weight_map)[:60]
            raise CheckpointError(f"{path / _SHARD_INDEX}: weight_map is {found}, expected "
                                  "{tensor name: safetensors file} (a JSON object)")
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise CheckpointError(f"{path / _SHARD_INDEX}: weight_map[{key!r}]={name!r} is not a file name")
        return sorted(set(weight_map.values())), weight_map
    if present(path, "model.safetensors"):
        return ["model.safetensors"], None
    raise CheckpointError(f"{path}: no model.safetensors (nor a sharded index); only safetensors weights are read")


class HFWeights(contextlib.AbstractContextManager):
    """The tensors of an HF directory's safetensors files, opened lazily: ``names``, ``shape``
    and ``dtype`` come from the headers; ``read`` reads one tensor. Use as a context manager
    (the files stay open inside it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        names, self._weight_map = _weight_files(self.path)
        where = f"{self.path / _SHARD_INDEX}: weight_map" if self._weight_map else str(self.path)
        self._files = {name: inside(self.path, name, where) for name in names}  # every path checked first
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        self._source: dict[str, str] = {}

    def __enter__(self) -> "HFWeights":
        try:
            for name, file in self._files.items():
                if not file.is_file():
                    raise CheckpointError(f"{self.path / name}: missing (or not a regular file)")
                try:
                    handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                    keys = list(handle.keys())
                except (SafetensorError, OSError, ValueError) as err:
                    raise CheckpointError(f"{self.path / name}: not a readable safetensors file ({err})") from None
                for key in keys:
                    if key in self._source:
                        raise CheckpointError(f"{self.path}: tensor {key!r} is in both {self._source[key]} and {name}")
                    self._source[key], self._handles[key] = name, handle
            for key, name in (self._weight_map or {}).items():
                if self._source.get(key) != name:
                    raise CheckpointError(f"{self.path / _SHARD_INDEX}: weight_map puts {key!r} in {name}, which does "
                                          "not hold it")
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def names(self) -> set[str]:
        return set(self._source)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())  # type: ignore[attr-defined]

    def dtype(self, name: str) -> torch.dtype | str:
        """The tensor's torch dtype (the safetensors name where torch has none here)."""
        raw = self._handles[name].get_slice(name).get_dtype()  # type: ignore[attr-defined]
        return _DTYPES.get(raw, raw)

    def read(self, name: str) -> torch.Tensor:
        try:
            return self._handles[name].get_tensor(name)  # type: ignore[attr-defined]
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{self.path / self._source[name]}: tensor {name!r} cannot be read ({err})") from None


def parse_size(value: int | str, name: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"2GiB"`` (transformers'
    units: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024); ``ValueError`` naming ``name``."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", value)) and m[2].upper() in units:
        size = int(m[1]) * units[m[2].upper()]
    else:
        raise ValueError(f"{name} must be a byte count or a size such as '5GB' or '500MiB', got {value!r}")
    if size < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
    return size


Group = tuple[dict[str, int], Callable[[], dict[str, torch.Tensor]]]


def _shards(groups: Sequence[Group], max_bytes: int) -> list[list[int]]:
    """Group indices per shard, in order, each shard filled up to ``max_bytes``."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (sizes, _) in enumerate(groups):
        nbytes = sum(sizes.values())
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def write_hf(path: str | os.PathLike, config: dict, groups: Sequence[Group], *,
             max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write ``config.json`` and the tensors of ``groups`` (each: ``{name: bytes}`` and a function
    making those tensors, called only when its shard is written), sharded past
    ``max_shard_size``. Returns the directory."""
    path = Path(path)
    max_bytes = parse_size(max_shard_size)
    plan = _shards(groups, max_bytes)
    files = ["model.safetensors"] if len(plan) == 1 else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
                                                          for i in range(len(plan))]
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():  # an earlier export's weights would disagree with the new index
        if (old.name in ("model.safetensors", _SHARD_INDEX) or _SHARD_NAME.fullmatch(old.name)) and old.name not in files:
            old.unlink()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weight_map: dict[str, str] = {}
    for file, members in zip(files, plan):
        tensors: dict[str, torch.Tensor] = {}
        for i in members:
            made = groups[i][1]()
            if set(made) != set(groups[i][0]):
                raise RuntimeError(f"a tensor group made {sorted(made)[:3]}, planned {sorted(groups[i][0])[:3]}")
            tensors.update({k: v.detach().contiguous() for k, v in made.items()})
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        total = sum(sum(sizes.values()) for sizes, _ in groups)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / _SHARD_INDEX).write_text(json.dumps(index, indent=2))
    return path
