"""Packed CPU experts: what stands in for the built-in experts of a CPU compiled decode for the
length of one generation (legend: moeflow.types; ``F`` the width of ``w_in``).

A decode step multiplies a few rows per expert by expert weights that come from memory, which a
BLAS runs far below the memory's rate and ``moeflow.kernels.packed_cpu``'s few-row kernel near it
(``docs/benchmarks.md``). ``PackedCPUExperts`` follows the experts protocol over packed copies
of one ``GroupedExperts``' weights. The compiled decoder (``moeflow.models.compiled_decode``)
puts one in place of every MoE layer's experts that ``packable`` accepts when a generation
starts, packed from the weights as they are then (a write through ``.data``, as an EMA does,
moves no version counter, so packs are never trusted from one generation to the next), and puts
the experts back when it ends, in a ``finally``. Nothing else sees packs: the experts' own
no-grad path (``moeflow.experts.lean``) knows nothing of them.

A stand-in sends to the experts it stands in for the calls the kernel is not for: more than
``MAX_ROWS_PER_EXPERT`` rows per expert on average (a long prompt's prefill), no rows, the
padded ``[E, C, D]`` layout, calls in grad mode (never in a generation) and calls under
autocast. Under ``torch.compile`` its FFN is one opaque op (``moeflow::packed_ffn``: dynamo
cannot trace into the kernel); eager calls skip the op's dispatch. The readable reference is
``GroupedExperts`` itself (the tests compare outputs, equal up to rounding: the products sum in
another order).
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.experts.ffn import GroupedExperts
from moeflow.kernels.activation import activate_reference
from moeflow.kernels.packed_cpu import MAX_ROWS_PER_EXPERT, copy_into, pack_into, pack_weight, packed_grouped_mm

__all__ = ["packable", "PackedCPUExperts", "packed_ffn"]


def packable(experts: object) -> bool:
    """The one rule for which experts a ``PackedCPUExperts`` stands in for: the built-in
    ``GroupedExperts`` (exactly: a subclass may compute something else) whose no-grad grouped
    calls run the two grouped products the kernel replaces (with or without biases: the kernel
    starts each product from its bias), i.e. no recompute and the ``"grouped_mm"`` backend as
    resolved for its weights, on fp32 CPU weights (the kernel's). Any activation: it runs
    between the two products in torch."""
    if type(experts) is not GroupedExperts:
        return False
    w_in, w_out = experts.w_in, experts.w_out
    return (not experts.config.recompute
            and w_in.dtype == w_out.dtype == torch.float32 and w_in.device.type == w_out.device.type == "cpu"
            and experts.grouped_backend(w_in.device, w_in.dtype) == "grouped_mm")


def packed_ffn(x_RD: torch.Tensor, packed_in: torch.Tensor, packed_out: torch.Tensor, counts_E: torch.Tensor, *,
               activation: str, width_in: int, width_out: int, b_in: torch.Tensor | None = None,
               b_out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x W_in[e] + b_in[e]) W_out[e] + b_out[e]`` per expert over packed weights
    (``pack_weight`` of ``w_in [E, D, F]`` and ``w_out [E, H, D]``; ``width_in = F``,
    ``width_out = D``; the biases ``[E, F]`` and ``[E, D]`` optional) for rows grouped by expert
    (``counts_E``): ``[R, D]``. Under ``torch.compile``: one opaque op."""
    if torch.compiler.is_compiling():
        return _packed_ffn_op(x_RD, packed_in, packed_out, counts_E, activation, width_in, width_out, b_in, b_out)
    return _packed_ffn(x_RD, packed_in, packed_out, counts_E, activation, width_in, width_out, b_in, b_out)


def _packed_ffn(x_RD: torch.Tensor, packed_in: torch.Tensor, packed_out: torch.Tensor, counts_E: torch.Tensor,
                activation: str, width_in: int, width_out: int, b_in: torch.Tensor | None,
                b_out: torch.Tensor | None) -> torch.Tensor:
    h_RF = packed_grouped_mm(x_RD, packed_in, counts_E, width_in, b_in)
    return packed_grouped_mm(activate_reference(h_RF, activation), packed_out, counts_E, width_out, b_out)


@torch.library.custom_op("moeflow::packed_ffn", mutates_args=())
def _packed_ffn_op(x_RD: torch.Tensor, packed_in: torch.Tensor, packed_out: torch.Tensor, counts_E: torch.Tensor,
                   activation: str, width_in: int, width_out: int, b_in: torch.Tensor | None,
                   b_out: torch.Tensor | None) -> torch.Tensor:
    return _packed_ffn(x_RD, packed_in, packed_out, counts_E, activation, width_in, width_out, b_in, b_out)


@_packed_ffn_op.register_fake
def _(x_RD, packed_in, packed_out, counts_E, activation, width_in, width_out, b_in, b_out):  # type: ignore[no-untyped-def]
    return x_RD.new_empty((x_RD.shape[0], width_out))


class PackedCPUExperts(nn.Module):
    """A decode-only stand-in for ``experts`` (a ``GroupedExperts`` that ``packable`` accepts):
    its FFN over packed copies of the weights (``packed_in [E, S, D, 16]``, ``packed_out [E, S',
    H, 16]``, and copies ``bias_in``/``bias_out`` of the biases, or None: buffers that are not
    saved), the experts themselves for the calls the kernel is not
    for (module docstring). It holds the experts without making them a submodule (``source``):
    while it stands in, the model's parameters are not counted twice. ``repack`` packs (again)
    from the experts' weights as they are, into the same memory where the shapes allow, which is
    what lets a compiled step that read these buffers run on the new values."""

    resident = True

    def __init__(self, experts: GroupedExperts) -> None:
        super().__init__()
        if not packable(experts):
            raise ValueError(f"experts must be fp32 CPU GroupedExperts without recompute on the grouped_mm "
                             f"backend (moeflow.experts.packed.packable), got {type(experts).__name__}")
        self.register_buffer("packed_in", pack_weight(experts.w_in), persistent=False)
        self.register_buffer("packed_out", pack_weight(experts.w_out), persistent=False)
        for name, b in (("bias_in", experts.b_in), ("bias_out", experts.b_out)):
            self.register_buffer(name, copy_into(b, None), persistent=False)
        self._take(experts)

    def _take(self, experts: GroupedExperts) -> None:
        object.__setattr__(self, "source", experts)  # (not a submodule: see the class docstring)
        self.num_experts, self.activation = experts.num_experts, experts.config.activation
        self.width_in, self.width_out = experts.w_in.shape[-1], experts.w_out.shape[-1]
        self.train(experts.training)

    def repack(self, experts: GroupedExperts) -> None:
        """Stand in for ``experts`` (``packable``) from now on, packed from their weights as they
        are now: into the buffers of before where the shapes match, else into new ones."""
        if not packable(experts):
            raise ValueError(f"experts are not packable (moeflow.experts.packed.packable): {type(experts).__name__}")
        for name, w in (("packed_in", experts.w_in), ("packed_out", experts.w_out)):
            setattr(self, name, pack_into(w, getattr(self, name)))
        for name, b in (("bias_in", experts.b_in), ("bias_out", experts.b_out)):
            setattr(self, name, copy_into(b, getattr(self, name)))
        self._take(experts)

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        rows = expert_in.shape[0]
        if (expert_in.dim() != 2 or rows == 0 or rows > MAX_ROWS_PER_EXPERT * self.num_experts
                or torch.is_grad_enabled() or torch.is_autocast_enabled(expert_in.device.type)):
            return self.source(expert_in, counts_E)
        return packed_ffn(expert_in, self.packed_in, self.packed_out, counts_E, activation=self.activation,
                          width_in=self.width_in, width_out=self.width_out, b_in=self.bias_in, b_out=self.bias_out)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, activation={self.activation}, packs of {type(self.source).__name__}"

