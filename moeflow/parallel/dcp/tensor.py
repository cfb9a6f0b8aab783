"""``ChunkedTensor``: a global tensor of which this process holds some boxes, in the form
``torch.distributed.checkpoint`` (DCP) understands.

DCP stores a tensor under one key with its global shape and a list of chunks (offsets and
sizes), each written by one rank, and loads any box of it into any layout: that is how a
checkpoint written by ``W`` ranks loads on ``W'``. DTensor describes its chunk with a device mesh
and placements, which can say "rank ``r`` holds rows ``[r*E/W, (r+1)*E/W)``" but not what expert
parallelism needs besides: several separate chunks per rank (a load-aware placement puts any
expert in any slot), replicas that only one rank may write, the column blocks of a hidden slice
of a gated expert, or the vocabulary's parts that differ by one row. ``ChunkedTensor`` lists its
chunks explicitly and implements DCP's checkpointable protocol (``__create_write_items__`` for
saving, ``__create_chunk_list__`` and ``__get_tensor_shard__`` for both), so DCP plans, writes,
stages (``async_save``) and reshards it like a DTensor.

Each chunk is a view of the tensor that holds it (a parameter, an optimizer moment): DCP loads
straight into the model, and its writer copies a view into its own storage before writing it.
Only chunks marked ``saved`` are written (the first replica of a replicated expert), so every
element of the global tensor is written exactly once, which DCP checks when it plans a save.
The tensor itself has no data: every other operation on it raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # DCP is imported where it calls in (importing it costs ~1 s of CPU at every start)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["ChunkedTensor"]

_aten = torch.ops.aten


class ChunkedTensor(torch.Tensor):
    """A tensor of global ``shape`` of which this process holds ``chunks``.

    ``chunks``: ``(offsets, tensor, saved)`` per box: ``tensor`` (the same rank as ``shape``) holds
    the global elements ``[offsets[d], offsets[d] + tensor.shape[d])`` of every dim ``d``; ``saved``
    says whether this process writes it (False for a copy another rank writes). Two chunks of
    one process may not share an offset. ``dtype``/``device`` are the chunks' (needed when there
    are none).
    """

    _offsets: list[tuple[int, ...]]
    _tensors: list[torch.Tensor]
    _saved: list[bool]

    @staticmethod
    def __new__(cls, shape: Sequence[int], chunks: Sequence[tuple[Sequence[int], torch.Tensor, bool]], *,
                dtype: torch.dtype, device: torch.device | str) -> ChunkedTensor:
        shape = tuple(int(s) for s in shape)
        for offsets, t, _ in chunks:
            end = [o + s for o, s in zip(offsets, t.shape)]
            if len(offsets) != len(shape) or t.dim() != len(shape) or any(
                    o < 0 or e > s for o, e, s in zip(offsets, end, shape)):
                raise ValueError(f"chunk at offsets {tuple(offsets)} with shape {tuple(t.shape)} does not fit in "
                                 f"the global shape {shape}")
            if t.dtype != dtype:
                raise ValueError(f"chunk at offsets {tuple(offsets)} has dtype {t.dtype}, the tensor {dtype}")
        offsets_list = [tuple(int(o) for o in c[0]) for c in chunks]
        if len(set(offsets_list)) != len(offsets_list):
            raise ValueError(f"two chunks share an offset: {offsets_list}")
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        r._offsets = offsets_list
        r._tensors = [c[1] for c in chunks]
        r._saved = [bool(c[2]) for c in chunks]
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
        # ``async_save`` stages a copy: ``new_empty`` and then a deep copy of the attributes
        # (the chunks), which is all a ChunkedTensor holds
        if func is _aten.new_empty.default:
            self, size = args[0], args[1]
            kw = kwargs or {}
            return cls(size, [], dtype=kw.get("dtype") or self.dtype, device=kw.get("device") or self.device)
        raise NotImplementedError(
            f"{func} is not defined on a ChunkedTensor: it is a checkpoint view of a global tensor (shape "
            f"{tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else '?'}) whose chunks are "
            "views of the model's tensors; read them with .chunks()")

    def chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor, bool]]:
        """``(offsets, tensor, saved)`` of every chunk this process holds."""
        return list(zip(self._offsets, self._tensors, self._saved))

    def __repr__(self) -> str:  # type: ignore[override]
        held = ", ".join(f"{o}+{tuple(t.shape)}{'' if s else ' (not saved here)'}"
                         for o, t, s in self.chunks())
        return f"ChunkedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, chunks=[{held}])"

    # ------------------------------------------------------------ DCP's checkpointable protocol

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(o)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.shape,
                ),
            )
            for o, t, saved in self.chunks() if saved
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape)
                for o, t in zip(self._offsets, self._tensors)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        i = index.index
        if i is not None and i < len(self._offsets) and torch.Size(self._offsets[i]) == index.offset:
            return self._tensors[i]
        for o, t in zip(self._offsets, self._tensors):
            if torch.Size(o) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this process holds no chunk at offsets {tuple(index.offset or ())} "
                         f"(it holds {self._offsets})")
