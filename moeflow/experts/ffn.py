"""Expert feed-forward networks (legend: moeflow.types).

Every experts module follows one protocol, ``forward(expert_in, counts_E) -> expert_out``, with
two input layouts chosen by the dispatcher:

- ``[E, C, D]`` (capacity mode): expert ``e`` owns slice ``e``; only its first ``counts_E[e]``
  rows are real, the rest are zero padding whose output is ignored. Computed as batched matmul
  for every backend (equal-size groups are what ``bmm`` is for).
- ``[R, D]`` grouped (dropless): rows grouped contiguously by expert, ``counts_E[e]`` rows each,
  ``R == counts_E.sum()``. Computed as a grouped GEMM. The output has the input's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moeflow.config import ExpertsConfig
from moeflow.experts.fp8 import check_fp8_shapes, fp8_grouped_ffn
from moeflow.experts.lean import lean_ffn, lean_ffn_no_grad
from moeflow.experts.slices import cut_hidden_slice, join_hidden_slices  # (re-exported: importers use this module)
from moeflow.kernels.activation import ACTIVATIONS, GATED
from moeflow.kernels.activation import activate_reference as activate  # (a module-level name: stage_profile labels it)
from moeflow.kernels.grouped_mm import GROUPED_MM_BACKENDS, resolve_grouped_mm_backend

__all__ = ["Experts", "GroupedExperts", "ModuleExperts", "DenseFFN", "activate", "grouped_ffn", "mark_expert_parameters", "graph_zero",
           "cut_hidden_slice", "join_hidden_slices", "autocast_cast"]


@runtime_checkable
class Experts(Protocol):
    """What the MoE layer calls. ``num_experts`` is the number of experts held *here*;
    ``resident`` says whether the module holds its parameters itself (False when they live
    elsewhere, e.g. in ``moeflow.storage``'s tiers, which checkpoints cannot read in place;
    optional for user modules, which are taken as resident without it)."""

    num_experts: int
    resident: bool

    def __call__(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor: ...


def autocast_cast(like: torch.Tensor, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` in the autocast dtype of ``like``'s device while autocast is on there, else
    unchanged (None stays None). ``F.grouped_mm`` and moeflow's grouped backward are not
    autocast-aware, unlike ``bmm``, so every grouped expert GEMM casts its operands here."""
    device_type = like.device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dt = torch.get_autocast_dtype(device_type)
    return tuple(None if t is None else t.to(dt) for t in tensors)


def graph_zero(module: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """A scalar 0 (dtype of ``like``) that depends on ``like`` and every parameter of
    ``module``: added to an output that no computation produced (no rows, no tokens), it keeps
    the output in the autograd graph, so backward gives zero gradients everywhere and a
    parallel dispatcher still runs its backward exchange on this rank."""
    zero = like.sum() * 0
    for p in module.parameters():
        zero = zero + p.sum().to(like.dtype) * 0
    return zero


def mark_expert_parameters(module: nn.Module) -> None:
    """Tag parameters that belong to routed experts (``p.moeflow_expert = True``) so data-parallel
    wrappers can skip or scope their gradient averaging."""
    for p in module.parameters():
        p.moeflow_expert = True  # type: ignore[attr-defined]


class GroupedExperts(nn.Module):
    """``E`` FFN experts stored as 3-D weights.

    ``recompute`` (keyword, default ``config.recompute``): see ``ExpertsConfig.recompute``.

    Parameters:
        w_in: ``[E, D, F]`` (``F = 2H`` for gated activations: gate columns first, then up).
        w_out: ``[E, H, D]``.
        b_in: ``[E, F]`` and b_out: ``[E, D]`` when ``config.bias``.
    """

    resident = True

    def __init__(
        self,
        *,
        num_experts: int,
        dim: int,
        hidden: int,
        config: ExpertsConfig | None = None,
        recompute: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config if config is not None else ExpertsConfig()
        if recompute is not None:
            self.recompute = recompute
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self._backends: dict[tuple, str] = {}  # grouped_backend's answers
        width = 2 * hidden if self.config.gated else hidden
        if self.config.fp8 is not None:  # (the device is checked at the first forward: modules move)
            check_fp8_shapes(dim, hidden, width)
        kw = {"device": device, "dtype": dtype}
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, width, **kw))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, dim, **kw))
        if self.config.bias:
            self.b_in = nn.Parameter(torch.empty(num_experts, width, **kw))
            self.b_out = nn.Parameter(torch.empty(num_experts, dim, **kw))
        else:
            self.register_parameter("b_in", None)
            self.register_parameter("b_out", None)
        self.reset_parameters()
        mark_expert_parameters(self)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, std=self.config.init_std)
        nn.init.normal_(self.w_out, std=self.config.init_std)
        if self.b_in is not None:
            nn.init.zeros_(self.b_in)
            nn.init.zeros_(self.b_out)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, "
            f"activation={self.config.activation}, bias={self.config.bias}, backend={self.config.backend}"
        )

    def shard(self, start: int, count: int) -> "GroupedExperts":
        """A new module holding copies of experts ``[start, start + count)`` (expert parallelism)."""
        if not 0 <= start < start + count <= self.num_experts:
            raise ValueError(f"shard [{start}, {start + count}) is outside the {self.num_experts} experts")
        part = GroupedExperts(
            num_experts=count, dim=self.dim, hidden=self.hidden, config=self.config,
            device=self.w_in.device, dtype=self.w_in.dtype,
        )
        with torch.no_grad():  # (not a decorator: mutation testing leaves decorated functions alone)
            for name, param in self.named_parameters():
                getattr(part, name).copy_(param[start : start + count])
        return part

    def hidden_slices(self, r: int) -> "GroupedExperts":
        """A new module of ``E * r`` experts of hidden size ``H / r``: expert ``j * E + x``
        holds hidden units ``[j*H/r, (j+1)*H/r)`` of expert ``x`` (gate and up columns alike).
        Slice-major order, so that sharding the result over ranks puts the ``r`` slices of an
        expert on ``r`` different ranks. The hidden units of an FFN are independent, so the
        slices' outputs add up to the expert's output (for that, ``b_out`` must be absent:
        ``bias=False``)."""
        if not isinstance(r, int) or r < 1 or self.hidden % r:
            raise ValueError(f"hidden slices r={r!r} must be a positive divisor of hidden={self.hidden}")
        if self.config.bias:
            raise ValueError("hidden slices need experts without biases (bias=False): b_out would be added r times")
        out = GroupedExperts(num_experts=self.num_experts * r, dim=self.dim, hidden=self.hidden // r,
                             config=self.config, device=self.w_in.device, dtype=self.w_in.dtype)
        with torch.no_grad():
            for name in ("w_in", "w_out"):  # slice j of all experts, for j = 0 .. r-1
                full = getattr(self, name)
                getattr(out, name).copy_(torch.cat([cut_hidden_slice(name, full, r, j, self.halves) for j in range(r)]))
        return out

    @property
    def recompute(self) -> bool:
        """Expert recompute (``ExpertsConfig.recompute``): backward recomputes the hidden
        activation from the saved input rows instead of keeping it. Settable at any time
        (turning it off drops ``recompute_chunks``, which applies with it only)."""
        return self.config.recompute

    @recompute.setter
    def recompute(self, value: bool) -> None:
        chunks = self.config.recompute_chunks if value is True else None
        self.config = dataclasses.replace(self.config, recompute=value, recompute_chunks=chunks)

    @property
    def halves(self) -> int:
        """Column blocks of ``w_in`` per hidden unit: 2 for gated activations (gate, up), else 1."""
        return self.w_in.shape[-1] // self.hidden

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if expert_in.numel() == 0:
            # no rows here (e.g. this rank's experts got no tokens): an empty output that still
            # gives every weight a (zero) gradient, so all ranks run the same backward
            return expert_in.new_zeros(*expert_in.shape[:-1], self.dim) + graph_zero(self, expert_in)
        if expert_in.dim() == 3:
            return self._forward_padded(expert_in)
        if expert_in.dim() == 2:
            return self._forward_grouped(expert_in, counts_E)
        raise ValueError(f"expert_in must be [E, C, D] or [R, D], got shape {tuple(expert_in.shape)}")

    def _forward_padded(self, x_ECD: torch.Tensor) -> torch.Tensor:
        if self.config.fp8 is not None:  # the [E, C, D] slots as E groups of C rows
            counts_E = torch.full(x_ECD.shape[:1], x_ECD.shape[1], device=x_ECD.device, dtype=torch.int64)
            return self._forward_grouped(x_ECD.flatten(0, 1), counts_E).view(x_ECD.shape)
        if self.b_in is None and self.b_out is None:
            x_ECD, w_in, w_out = autocast_cast(x_ECD, x_ECD, self.w_in, self.w_out)
            return lean_ffn(x_ECD, w_in, w_out, None, activation=self.config.activation, gemm="bmm",
                            recompute=self.config.recompute, chunks=self.config.recompute_chunks)
        if self.config.recompute:
            return checkpoint(self._forward_padded_autograd, x_ECD, use_reentrant=False)
        return self._forward_padded_autograd(x_ECD)

    def _forward_padded_autograd(self, x_ECD: torch.Tensor) -> torch.Tensor:
        """With biases (``config.bias`` makes both): plain autograd (``recompute`` wraps it in
        ``torch.utils.checkpoint``)."""
        h_ECF = torch.baddbmm(self.b_in.unsqueeze(1), x_ECD, self.w_in)
        a_ECH = activate(h_ECF, self.config.activation)
        return torch.baddbmm(self.b_out.unsqueeze(1), a_ECH, self.w_out)

    def grouped_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        """The grouped GEMM ``config.backend`` stands for with operands of ``dtype`` on ``device``
        and this module's weight shapes (``resolve_grouped_mm_backend``): resolved once per
        backend, device, dtype and shapes, and kept, so a grouped call resolves nothing (under
        ``torch.compile`` the answer is taken at trace time)."""
        dims = (self.w_in.shape[-2], self.w_in.shape[-1], self.w_out.shape[-2])
        if torch.compiler.is_compiling():
            return resolve_grouped_mm_backend(self.config.backend, device, dtype, dims)
        key = (self.config.backend, device, dtype, dims)
        answers = self.__dict__.setdefault("_backends", {})  # (a module pickled before it kept them has none)
        name = answers.get(key)
        if name is None:
            name = answers[key] = resolve_grouped_mm_backend(self.config.backend, device, dtype, dims)
        return name

    def ffn_options(self) -> dict[str, object]:
        """The keyword arguments of ``grouped_ffn`` this module's config sets (activation,
        backend, recompute and its chunks). The expert-parallel strategies run the same FFN on
        weights they gather or slice, and take them from here so none is dropped on the way."""
        fp8 = {} if self.config.fp8 is None else {"fp8": self.config.fp8, "fp8_gemm": self.config.fp8_gemm}
        return {"activation": self.config.activation, "backend": self.config.backend,
                "recompute": self.config.recompute, "recompute_chunks": self.config.recompute_chunks, **fp8}

    def _forward_grouped(self, x_RD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        x_RD, w_in, w_out, b_in, b_out = autocast_cast(x_RD, x_RD, self.w_in, self.w_out, self.b_in, self.b_out)
        cfg = self.config
        if cfg.fp8 is not None:  # (no biases: ExpertsConfig checks)
            return fp8_grouped_ffn(x_RD, counts_E, w_in, w_out, activation=cfg.activation, gemm=cfg.fp8_gemm)
        return _grouped_ffn(self.grouped_backend(x_RD.device, x_RD.dtype), x_RD, counts_E, w_in, w_out,  # type: ignore[arg-type]
                            b_in, b_out, cfg.activation, cfg.recompute, cfg.recompute_chunks)


def grouped_ffn(
    x_RD: torch.Tensor,
    counts_E: torch.Tensor,
    w_in_EDF: torch.Tensor,
    w_out_EHD: torch.Tensor,
    b_in_EF: torch.Tensor | None = None,
    b_out_ED: torch.Tensor | None = None,
    *,
    activation: str | Callable[[torch.Tensor], torch.Tensor],
    backend: str = "auto",
    recompute: bool = False,
    recompute_chunks: int | None = None,
    fp8: str | None = None, fp8_gemm: str = "scaled_grouped_mm",
) -> torch.Tensor:
    """``y_RD = act(x_RD W_in[e] + b_in[e]) W_out[e] + b_out[e]`` on rows grouped by expert.

    ``counts_E[e]`` rows belong to expert ``e`` (``R == counts_E.sum()``). The weights may be
    any strided views (e.g. the transpose of a ``[E, F, D]`` parameter), so callers holding
    other layouts (Hugging Face ``gate_up_proj``) use their tensors without a copy.
    ``activation`` is a name for ``activate`` or a callable ``[R, F] -> [R, H]`` (a custom gate).
    ``backend`` picks the grouped matmul (``moeflow.kernels.grouped_mm``; ``"auto"`` probes).
    With ``"triton"``, a named activation and no biases, the whole FFN is
    ``moeflow.kernels.triton.grouped_ffn_triton`` (activation fused into the GEMM epilogues);
    otherwise the Triton grouped GEMM runs with the activation and biases in torch.
    Without biases, a named activation and the ``"grouped_mm"`` or ``"loop"`` backend, the FFN
    is ``moeflow.experts.lean.lean_ffn`` (saves the input rows and the pre-activation only; its
    two products are called directly when autograd has nothing to record, e.g. ``no_grad``).
    ``recompute``: keep only the input rows for backward and recompute the hidden activation
    there (``lean_ffn``, or ``torch.utils.checkpoint`` around the other paths); the same
    gradients, less memory between forward and backward, one more GEMM in backward;
    ``recompute_chunks``: ``ExpertsConfig.recompute_chunks`` (``lean_ffn``'s ``chunks``).
    ``fp8``, ``fp8_gemm``: ``ExpertsConfig``'s; ``fp8="rowwise"`` runs ``moeflow.experts.fp8``.
    """
    if fp8 is not None:
        if fp8 != "rowwise" or b_in_EF is not None or b_out_ED is not None or recompute:
            raise ValueError(f"grouped_ffn: fp8={fp8!r} needs fp8='rowwise', no biases and recompute=False")
        return fp8_grouped_ffn(x_RD, counts_E, w_in_EDF, w_out_EHD, activation=activation, gemm=fp8_gemm)  # type: ignore[arg-type]
    dims = (w_in_EDF.shape[-2], w_in_EDF.shape[-1], w_out_EHD.shape[-2])
    name = resolve_grouped_mm_backend(backend, x_RD.device, x_RD.dtype, dims)
    return _grouped_ffn(name, x_RD, counts_E, w_in_EDF, w_out_EHD, b_in_EF, b_out_ED, activation, recompute,
                        recompute_chunks)


def _grouped_ffn(name: str, x_RD: torch.Tensor, counts_E: torch.Tensor, w_in_EDF: torch.Tensor,
                 w_out_EHD: torch.Tensor, b_in_EF: torch.Tensor | None, b_out_ED: torch.Tensor | None,
                 activation: str | Callable[[torch.Tensor], torch.Tensor], recompute: bool,
                 recompute_chunks: int | None) -> torch.Tensor:
    """``grouped_ffn`` once ``backend`` is resolved to ``name`` (``GroupedExperts`` resolves its
    own once: ``grouped_backend``)."""
    if name == "triton" and b_in_EF is None and b_out_ED is None and isinstance(activation, str) and not recompute:
        # both GEMMs and the activation (and its backward) in fused Triton kernels
        from moeflow.kernels.triton.grouped_gemm import grouped_ffn_triton

        return grouped_ffn_triton(x_RD, counts_E, w_in_EDF, w_out_EHD, activation=activation)
    biased = b_in_EF is not None or b_out_ED is not None
    # lean_ffn_no_grad: the two grouped products alone, where autograd has nothing to record
    if (name == "grouped_mm" and not biased and activation in ACTIVATIONS and not recompute
            and not torch.is_autocast_enabled(x_RD.device.type)  # (lean turns it off inside)
            and not (torch.is_grad_enabled() and (x_RD.requires_grad or w_in_EDF.requires_grad or w_out_EHD.requires_grad))):
        return lean_ffn_no_grad(x_RD, w_in_EDF, w_out_EHD, counts_E, activation=activation)  # nothing to record
    if not biased and activation in ACTIVATIONS and name in ("grouped_mm", "loop"):
        offs_E = torch.cumsum(counts_E, 0)
        return lean_ffn(x_RD, w_in_EDF, w_out_EHD, offs_E.to(torch.int32) if name == "grouped_mm" else offs_E,
                        activation=activation, gemm=name, recompute=recompute,
                        chunks=recompute_chunks if recompute else None)
    if recompute:
        return checkpoint(_grouped_ffn, name, x_RD, counts_E, w_in_EDF, w_out_EHD, b_in_EF, b_out_ED, activation,
                          False, None, use_reentrant=False)
    mm = GROUPED_MM_BACKENDS[name]
    offs_E = torch.cumsum(counts_E, 0)
    h_RF = mm(x_RD, w_in_EDF, offs_E)
    expert_R = None
    if b_in_EF is not None or b_out_ED is not None:
        # expert of each row, without a host sync
        expert_R = torch.searchsorted(offs_E, torch.arange(x_RD.shape[0], device=x_RD.device), right=True)
    if b_in_EF is not None:
        h_RF = h_RF + b_in_EF[expert_R]
    a_RH = activate(h_RF, activation) if isinstance(activation, str) else activation(h_RF)
    y_RD = mm(a_RH, w_out_EHD, offs_E)
    if b_out_ED is not None:
        y_RD = y_RD + b_out_ED[expert_R]
    return y_RD


class ModuleExperts(nn.Module):
    """Wrap any per-expert modules (each maps ``[N, D] -> [N, D]``) into the experts protocol.

    Runs one module per expert on its real rows only (reads the counts on the host). Use it for
    experts that are not plain FFNs; the built-in ``GroupedExperts`` is much faster for FFNs.
    """

    resident = True

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(modules) == 0:
            raise ValueError("modules must hold at least one expert module, got an empty sequence")
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(f"modules[{i}] must be an nn.Module, got {type(m).__name__}")
        self.experts = nn.ModuleList(modules)
        self.num_experts = len(modules)
        mark_expert_parameters(self)

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        counts = counts_E.tolist()
        # built from the input (and every parameter) so the output stays in the autograd graph
        # even when no expert runs here: parallel dispatchers need every rank's backward
        out = torch.zeros_like(expert_in) + graph_zero(self, expert_in)
        if expert_in.dim() == 3:
            for e, (module, n) in enumerate(zip(self.experts, counts)):
                if n:
                    out[e, :n] = module(expert_in[e, :n])
            return out
        start = 0
        for module, n in zip(self.experts, counts):
            if n:
                out[start : start + n] = module(expert_in[start : start + n])
            start += n
        return out


class DenseFFN(nn.Module):
    """An always-on FFN (shared experts): ``act(x W_in + b_in) W_out + b_out`` on ``[T, D]``,
    optionally scaled by a learned sigmoid gate per token (Qwen-MoE)."""

    def __init__(
        self,
        *,
        dim: int,
        hidden: int,
        activation: str,
        bias: bool = False,
        gate: bool = False,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.activation = activation
        width = 2 * hidden if activation in GATED else hidden
        kw = {"device": device, "dtype": dtype}
        self.proj_in = nn.Linear(dim, width, bias=bias, **kw)
        self.proj_out = nn.Linear(hidden, dim, bias=bias, **kw)
        self.gate = nn.Linear(dim, 1, bias=False, **kw) if gate else None
        for lin in (self.proj_in, self.proj_out):
            nn.init.normal_(lin.weight, std=init_std)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        y_TD = self.proj_out(activate(self.proj_in(x_TD), self.activation))
        if self.gate is not None:
            y_TD = torch.sigmoid(self.gate(x_TD)) * y_TD
        return y_TD
