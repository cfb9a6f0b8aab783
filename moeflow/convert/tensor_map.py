"""Where each moeflow tensor lives in a Hugging Face checkpoint, both ways.

An ``Entry`` is one tensor of ``MoEGPT.state_dict()`` (``ours``) and the ``Layout`` s it may be
stored in. A layout names its HF tensors and the two transforms between them: ``load`` (HF
tensors -> ours) and ``save`` (ours -> HF tensors, its inverse). The first layout is what
``--to-hf`` writes; later ones are read too (transformers' in-memory fused experts beside the
published per-expert tensors). An entry ``tied_to`` another (the output projection of tied
embeddings) is not written; where a checkpoint holds it anyway it must equal the other.

The HF shapes a layout expects are found by running ``save`` on a meta tensor of the moeflow
shape (``hf_shapes``), so each map states its transform once and the shape checks follow.

Legend: ``E`` experts, ``D`` model dim, ``H`` expert hidden dim; moeflow's experts are
``w_in [E, D, 2H]`` (gate columns, then up), ``w_out [E, H, D]``, ``b_in [E, 2H]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Entry", "Layout", "rename", "same", "linear_experts", "fused_experts", "stacked_rows", "dense_ffn",
           "hf_shapes"]

Tensors = Sequence[torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """HF tensors ``hf`` and the transforms to (``load``) and from (``save``) one moeflow tensor."""

    hf: tuple[str, ...]
    load: Callable[[Tensors], torch.Tensor]
    save: Callable[[torch.Tensor], Tensors]


@dataclass(frozen=True)
class Entry:
    """One moeflow tensor ``ours`` and the layouts it may be stored in (the first is written);
    an entry ``tied_to`` another comes after it in the map."""

    ours: str
    layouts: tuple[Layout, ...]
    tied_to: str | None = None

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError(f"Entry {self.ours!r} needs at least one layout")


def rename(hf: str) -> Layout:
    """A tensor stored under another name, unchanged."""
    return Layout((hf,), lambda t: t[0], lambda t: (t,))


def same(ours: str, *hf: str, tied_to: str | None = None) -> Entry:
    """An entry whose layouts are renames (``hf``: the names it may be stored under, the first
    written)."""
    return Entry(ours, tuple(rename(name) for name in hf), tied_to)


def linear_experts(patterns: Sequence[str], num_experts: int) -> Layout:
    """Per-expert ``F.linear`` weights (``patterns``, each with ``{e}``: e.g. Mixtral's ``w1``
    and ``w3``, each ``[H, D]``) <-> one ``[E, in, out]`` tensor: per expert, the patterns'
    weights concatenated along their output rows (gate rows, then up), then transposed."""
    names = tuple(p.format(e=e) for e in range(num_experts) for p in patterns)
    n = len(patterns)

    def load(ts: Tensors) -> torch.Tensor:
        return torch.stack([torch.cat(list(ts[e * n:(e + 1) * n])).T for e in range(num_experts)]).contiguous()

    def save(t_EIO: torch.Tensor) -> Tensors:
        return tuple(part.contiguous() for e in range(num_experts) for part in t_EIO[e].T.chunk(n))

    return Layout(names, load, save)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """``[..., 2H]`` halves (gate, up) -> alternating columns (gate at even, up at odd)."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Alternating columns (gate at even, up at odd) -> ``[..., 2H]`` halves (gate, up)."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def fused_experts(hf: str, *, transposed: bool, interleaved: bool = False) -> Layout:
    """One stacked expert tensor: ``transposed`` when stored ``[E, out, in]`` (transformers'
    in-memory ``gate_up_proj [E, 2H, D]`` and ``down_proj [E, D, H]``) rather than moeflow's
    ``[E, in, out]``; ``interleaved`` when gate and up alternate along the last dimension
    (gpt-oss's ``gate_up_proj [E, D, 2H]`` and its bias ``[E, 2H]``)."""

    def load(ts: Tensors) -> torch.Tensor:
        t = ts[0].transpose(-1, -2) if transposed else ts[0]
        return (_deinterleave(t) if interleaved else t).contiguous()

    def save(t: torch.Tensor) -> Tensors:
        t = _interleave(t) if interleaved else t
        return ((t.transpose(-1, -2) if transposed else t).contiguous(),)

    return Layout((hf,), load, save)


def stacked_rows(*hf: str) -> Layout:
    """``F.linear`` weights stored apart (gate, up: ``[H, D]`` each) <-> one ``[2H, D]`` (gate
    rows, then up): a ``DenseFFN``'s or the shared experts' ``proj_in``."""
    n = len(hf)

    def load(ts):  # type: ignore[no-untyped-def]
        return torch.cat(list(ts)).contiguous()

    def save(t: torch.Tensor):  # type: ignore[no-untyped-def]
        return tuple(part.contiguous() for part in t.chunk(n))

    return Layout(tuple(hf), load, save)


def dense_ffn(ours: str, hf: str) -> list[Entry]:
    """A gated FFN ``ours`` (``proj_in`` gate and up stacked, ``proj_out``) stored as ``hf``'s
    ``gate_proj``, ``up_proj`` and ``down_proj``: dense layers and shared experts."""
    return [Entry(f"{ours}.proj_in.weight", (stacked_rows(f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),)),
            same(f"{ours}.proj_out.weight", f"{hf}.down_proj.weight")]


def hf_shapes(layout: Layout, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The shape of each of ``layout``'s HF tensors for a moeflow tensor of ``shape``."""
    out = layout.save(torch.empty(tuple(shape), device="meta"))
    return {name: tuple(t.shape) for name, t in zip(layout.hf, out, strict=True)}
