"""FP8 weight-only inference: expert weights stored in float8 e4m3 (legend: moeflow.types; F =
width of ``w_in``; quantisation rule: ``moeflow.kernels.fp8``).

``quantize_experts_fp8(model)`` replaces every ``GroupedExperts`` of a model (biases off) by an
``FP8WeightExperts`` holding ``w_in_q [E, D, F]`` and ``w_out_q [E, H, D]`` in e4m3 with one fp32
scale per output column (``[E, F]``, ``[E, D]``: per output row of the ``nn.Linear`` each expert
projection is), quantised over the contracted dimension. Activations stay in their dtype.
Because each scale belongs to one output column, it factors out of the product:
``x @ (q * s) = (x @ q) * s``, so the product reads the e4m3 codes and scales the result.

Why: decode reads every active expert's weights once per step for a handful of rows, so its time
is the weights' bytes; e4m3 halves them against bf16. On CUDA (Triton importable, compute
capability 8.9+ for the e4m3 conversion) up to ``TRITON_MAX_ROWS`` rows run
``moeflow.kernels.triton.fp8.fp8_weight_grouped_mm_triton``, which widens the codes in registers;
more rows (prefill) and other devices dequantise the weights to the activations' dtype just
before a grouped GEMM (``fp8_weight_grouped_mm_reference``, the readable definition), where the
GEMM's arithmetic, not the weight bytes, is the cost. Inference only: the weights are buffers,
not parameters (the input still gets gradients on the reference path).
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.experts.ffn import GroupedExperts, mark_expert_parameters
from moeflow.kernels.activation import activate
from moeflow.kernels.fp8 import FP8_DTYPE, cuda_capability, quantize_columns_t
from moeflow.kernels.grouped_mm import grouped_mm
from moeflow.kernels.triton import triton_available

__all__ = ["FP8WeightExperts", "quantize_experts_fp8", "fp8_weight_grouped_mm", "fp8_weight_grouped_mm_reference",
           "TRITON_MAX_ROWS"]

TRITON_MAX_ROWS = 4096  # the Triton product's grid walks every row tile once per expert: for decode's rows


def quantize_columns(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, K, N]`` -> ``(q [E, K, N] e4m3, scale [E, N] fp32)``: one scale per output column
    over the ``K`` it is contracted with (``quantize_reference`` of the transpose; its Triton
    kernels on CUDA)."""
    q_ENK, scale_EN = quantize_columns_t(w_EKN.detach())
    return q_ENK.transpose(-2, -1).contiguous(), scale_EN.contiguous()


def fp8_weight_grouped_mm_reference(x_RK: torch.Tensor, w_q_EKN: torch.Tensor, scale_EN: torch.Tensor,
                                    offs_E: torch.Tensor) -> torch.Tensor:
    """The weights dequantised to ``x``'s dtype (``q * scale``), then a grouped GEMM
    (``moeflow.kernels.grouped_mm``'s ``"auto"``: ``F.grouped_mm`` where it runs on ``x``'s device
    and dtype, else one ``mm`` per group)."""
    w_EKN = (w_q_EKN.to(torch.float32) * scale_EN.unsqueeze(1)).to(x_RK.dtype)
    return grouped_mm(x_RK, w_EKN, offs_E, backend="auto")


def _triton_runs(x: torch.Tensor) -> bool:
    """``"auto"``'s choice: the kernel on CUDA of capability 8.9+ (never the CPU interpreter,
    which is for tests), for at most ``TRITON_MAX_ROWS`` rows and nothing to differentiate."""
    if x.device.type != "cuda" or x.shape[0] > TRITON_MAX_ROWS or not triton_available(x.device):
        return False
    if torch.is_grad_enabled() and x.requires_grad:  # (the kernel has no backward)
        return False
    return cuda_capability(x.device) >= (8, 9)


def fp8_weight_grouped_mm(x_RK: torch.Tensor, w_q_EKN: torch.Tensor, scale_EN: torch.Tensor, offs_E: torch.Tensor,
                          *, kernel: str = "auto") -> torch.Tensor:
    """``(x[rows of e] @ w_q[e]) * scale[e]`` in ``x``'s dtype. ``kernel``: ``"auto"`` (the
    module docstring's choice), ``"triton"`` or ``"reference"``."""
    if kernel not in ("auto", "triton", "reference"):
        raise ValueError(f"kernel must be one of ['auto', 'triton', 'reference'], got {kernel!r}")
    if kernel == "triton" or (kernel == "auto" and _triton_runs(x_RK)):
        return _fp8_weight_gmm_op(x_RK, w_q_EKN, scale_EN, offs_E)
    return fp8_weight_grouped_mm_reference(x_RK, w_q_EKN, scale_EN, offs_E)


# the Triton product as one opaque op: torch.compile (and a CUDA graph of a compiled decode step)
# records a call of it rather than tracing the launcher's checks and device guard
@torch.library.custom_op("moeflow::fp8_weight_grouped_mm", mutates_args=())
def _fp8_weight_gmm_op(x_RK: torch.Tensor, w_q_EKN: torch.Tensor, scale_EN: torch.Tensor,
                       offs_E: torch.Tensor) -> torch.Tensor:
    from moeflow.kernels.triton.fp8 import fp8_weight_grouped_mm_triton

    return fp8_weight_grouped_mm_triton(x_RK, w_q_EKN, scale_EN, offs_E)


@_fp8_weight_gmm_op.register_fake
def _(x_RK, w_q_EKN, scale_EN, offs_E):  # type: ignore[no-untyped-def]
    return x_RK.new_empty(x_RK.shape[0], w_q_EKN.shape[2])


class FP8WeightExperts(nn.Module):
    """The experts of a ``GroupedExperts`` (no biases) with their weights in e4m3 (module
    docstring); the same experts protocol, ``forward(expert_in, counts_E)`` in both layouts.

    Buffers: ``w_in_bits [E, D, F]``, ``w_in_scale [E, F]``, ``w_out_bits [E, H, D]``,
    ``w_out_scale [E, D]`` (the e4m3 codes as uint8; ``w_in_q`` / ``w_out_q`` view them as e4m3). ``kernel``: see ``fp8_weight_grouped_mm``."""

    resident = True

    def __init__(self, experts: GroupedExperts, *, kernel: str = "auto") -> None:
        super().__init__()
        if not isinstance(experts, GroupedExperts):
            raise TypeError(f"experts must be a GroupedExperts, got {type(experts).__name__}")
        if experts.b_in is not None or experts.b_out is not None:
            raise ValueError("FP8 weight-only experts need experts without biases (bias=False)")
        if kernel not in ("auto", "triton", "reference"):
            raise ValueError(f"kernel must be one of ['auto', 'triton', 'reference'], got {kernel!r}")
        self.num_experts, self.dim, self.hidden = experts.num_experts, experts.dim, experts.hidden
        self.activation, self.kernel = experts.config.activation, kernel
        for name in ("w_in", "w_out"):  # codes kept as uint8 bits: ``module.to(dtype)`` casts float buffers
            q, scale = quantize_columns(getattr(experts, name))
            self.register_buffer(f"{name}_bits", q.view(torch.uint8))
            self.register_buffer(f"{name}_scale", scale)
        mark_expert_parameters(self)

    @property
    def w_in_q(self) -> torch.Tensor:
        return self.w_in_bits.view(FP8_DTYPE)

    @property
    def w_out_q(self) -> torch.Tensor:
        return self.w_out_bits.view(FP8_DTYPE)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``nn.Module._apply`` (``.to``, ``.cuda``, ``.half``), then the scales back to fp32:
        a cast of the whole model to bf16 would otherwise round them."""
        super()._apply(fn, recurse)
        for name in ("w_in_scale", "w_out_scale"):
            self._buffers[name] = self._buffers[name].float()
        return self

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, activation={self.activation}, "
                f"weights={FP8_DTYPE}, kernel={self.kernel}")

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w_in [E, D, F], w_out [E, H, D])`` in fp32: the weights these experts compute with."""
        return (self.w_in_q.float() * self.w_in_scale.unsqueeze(1), self.w_out_q.float() * self.w_out_scale.unsqueeze(1))

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if expert_in.dim() == 3:  # [E, C, D]: E groups of C rows
            counts = torch.full(expert_in.shape[:1], expert_in.shape[1], device=expert_in.device, dtype=torch.int64)
            return self.forward(expert_in.flatten(0, 1), counts).view(expert_in.shape)
        if expert_in.dim() != 2:
            raise ValueError(f"expert_in must be [E, C, D] or [R, D], got shape {tuple(expert_in.shape)}")
        if expert_in.shape[0] == 0:
            return expert_in.new_zeros(0, self.dim)
        offs_E = torch.cumsum(counts_E, 0)
        h_RF = fp8_weight_grouped_mm(expert_in, self.w_in_q, self.w_in_scale, offs_E, kernel=self.kernel)
        a_RH = activate(h_RF, self.activation)
        return fp8_weight_grouped_mm(a_RH, self.w_out_q, self.w_out_scale, offs_E, kernel=self.kernel)


def quantize_experts_fp8(model: nn.Module, *, kernel: str = "auto") -> int:
    """Replace every ``GroupedExperts`` inside ``model`` (in place) by ``FP8WeightExperts`` of
    the same weights; returns how many were replaced. For inference: the replaced experts hold
    no parameters, so an optimizer or a checkpoint of ``model`` no longer sees them."""
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, GroupedExperts)]
    for parent, name, child in found:
        setattr(parent, name, FP8WeightExperts(child, kernel=kernel))
    return len(found)
