"""Tutel's expert modules in moeflow's experts protocol (legend: moeflow.types; O = output dim).

moeflow's dispatchers hand experts either ``[e, C, D]`` (capacity mode) or ``[R, D]`` rows
grouped by expert (dropless); see ``moeflow.experts``. These modules accept both:

- ``TutelFFNExperts``: Tutel's ``ffn`` experts, ``act(x W1^T + b1) W2 + b2`` with any callable
  activation and Tutel's parameter names and layouts (``batched_fc1_w [e, H, D]``,
  ``batched_fc2_w [e, H, O]``, ``batched_fc1_bias [e, H]``, ``batched_fc2_bias [e, O]``), so a
  Tutel expert state dict loads by name. Padded layout: two batched matmuls; grouped layout:
  moeflow's grouped GEMM.
- ``TutelLlamaExperts``: Tutel's ``llama_ffn`` (SwiGLU) experts as moeflow's ``GroupedExperts``.
- ``TutelCustomExperts``: wraps a Tutel ``custom`` expert module, called as
  ``module(x_eND, ctx)`` on the ``[e, N, D]`` layout as Tutel does; grouped rows are padded to
  the largest expert for the call and cut back afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import ExpertsConfig
from moeflow.experts.ffn import GroupedExperts, autocast_cast, graph_zero, grouped_ffn, mark_expert_parameters
from moeflow.kernels.grouped_mm import grouped_mm

__all__ = ["TutelFFNExperts", "TutelLlamaExperts", "TutelCustomExperts", "mark_tutel_expert"]


def mark_tutel_expert(module: nn.Module) -> None:
    """Tag expert parameters for both libraries: ``moeflow_expert`` (moeflow's DDP/FSDP
    helpers) and ``_tutel_expert`` (what Tutel sets and Tutel-aware code checks)."""
    mark_expert_parameters(module)
    for p in module.parameters():
        p._tutel_expert = True  # type: ignore[attr-defined]


def _relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


class TutelFFNExperts(nn.Module):
    """``num_experts`` FFN experts in Tutel's layout (see module docstring).

    ``activation_fn`` defaults to ReLU (some Tutel versions crash without it);
    ``activation_fn_with_self(h, experts)`` is called with this module instead, as Tutel calls it
    with its expert module (for activations that read expert state). Initialised
    like Tutel: each expert's weights and biases as a fresh ``nn.Linear``
    (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``).
    """

    def __init__(
        self,
        *,
        num_experts: int,
        model_dim: int,
        hidden_size_per_expert: int,
        output_dim: int | None = None,
        activation_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        activation_fn_with_self: Callable[[torch.Tensor, nn.Module], torch.Tensor] | None = None,
        has_fc1_bias: bool = True,
        has_fc2_bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        _init: bool = True,
    ) -> None:
        super().__init__()
        if activation_fn is not None and not callable(activation_fn):
            raise TypeError(f"experts['activation_fn'] must be callable, got {type(activation_fn).__name__}")
        if activation_fn_with_self is not None and (activation_fn is not None or not callable(activation_fn_with_self)):
            raise ValueError("experts['activation_fn_with_self'] must be a callable and excludes experts['activation_fn']")
        self.activation_fn_with_self = activation_fn_with_self
        self.num_experts, self.model_dim, self.hidden = num_experts, model_dim, hidden_size_per_expert
        self.output_dim = model_dim if output_dim is None else output_dim
        self.activation_fn = activation_fn if activation_fn is not None else _relu
        kw = {"device": device, "dtype": dtype}
        e, D, H, O = num_experts, model_dim, hidden_size_per_expert, self.output_dim
        self.batched_fc1_w = nn.Parameter(torch.empty(e, H, D, **kw))
        self.batched_fc2_w = nn.Parameter(torch.empty(e, H, O, **kw))
        self.batched_fc1_bias = nn.Parameter(torch.empty(e, H, **kw)) if has_fc1_bias else None
        self.batched_fc2_bias = nn.Parameter(torch.empty(e, O, **kw)) if has_fc2_bias else None
        if _init:
            self.reset_parameters()
        mark_tutel_expert(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        b1, b2 = 1 / math.sqrt(self.model_dim), 1 / math.sqrt(self.hidden)
        self.batched_fc1_w.uniform_(-b1, b1)
        self.batched_fc2_w.uniform_(-b2, b2)
        if self.batched_fc1_bias is not None:
            self.batched_fc1_bias.uniform_(-b1, b1)
        if self.batched_fc2_bias is not None:
            self.batched_fc2_bias.uniform_(-b2, b2)

    def tutel_named_parameters(self):  # type: ignore[no-untyped-def]
        """Parameters under Tutel's names (``batched_fc1_w``, ...)."""
        return self.named_parameters()

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation_fn_with_self is not None:
            return self.activation_fn_with_self(h, self)
        return self.activation_fn(h)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, model_dim={self.model_dim}, hidden={self.hidden}, output_dim={self.output_dim}"

    @torch.no_grad()
    def shard(self, start: int, count: int) -> "TutelFFNExperts":
        """Copies of experts ``[start, start + count)`` (used by ``moeflow.parallel.expert_parallel``)."""
        if not 0 <= start < start + count <= self.num_experts:
            raise ValueError(f"shard [{start}, {start + count}) is outside the {self.num_experts} experts")
        w = self.batched_fc1_w
        part = TutelFFNExperts(
            num_experts=count, model_dim=self.model_dim, hidden_size_per_expert=self.hidden, output_dim=self.output_dim,
            activation_fn=None if self.activation_fn_with_self is not None else self.activation_fn,
            activation_fn_with_self=self.activation_fn_with_self, has_fc1_bias=self.batched_fc1_bias is not None,
            has_fc2_bias=self.batched_fc2_bias is not None, device=w.device, dtype=w.dtype, _init=False,
        )
        for name, param in self.named_parameters():
            getattr(part, name).copy_(param[start : start + count])
        return part

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if expert_in.numel() == 0:
            return expert_in.new_zeros(*expert_in.shape[:-1], self.output_dim) + graph_zero(self, expert_in)
        if expert_in.dim() == 3:
            h_eCH = torch.bmm(expert_in, self.batched_fc1_w.transpose(1, 2))
            if self.batched_fc1_bias is not None:
                h_eCH = h_eCH + self.batched_fc1_bias.unsqueeze(1)
            y_eCO = torch.bmm(self._activate(h_eCH), self.batched_fc2_w)
            if self.batched_fc2_bias is not None:
                y_eCO = y_eCO + self.batched_fc2_bias.unsqueeze(1)
            return y_eCO
        if expert_in.dim() != 2:
            raise ValueError(f"expert_in must be [e, C, D] or [R, D], got shape {tuple(expert_in.shape)}")
        x_RD, w1, b1, w2, b2 = expert_in, self.batched_fc1_w, self.batched_fc1_bias, self.batched_fc2_w, self.batched_fc2_bias
        x_RD, w1, b1, w2, b2 = autocast_cast(x_RD, x_RD, w1, b1, w2, b2)
        offs_E = torch.cumsum(counts_E, 0)
        expert_R = torch.searchsorted(offs_E, torch.arange(x_RD.shape[0], device=x_RD.device), right=True)
        h_RH = grouped_mm(x_RD, w1.transpose(1, 2).contiguous(), offs_E)
        if b1 is not None:
            h_RH = h_RH + b1[expert_R]
        y_RO = grouped_mm(self._activate(h_RH), w2, offs_E)
        if b2 is not None:
            y_RO = y_RO + b2[expert_R]
        return y_RO


class TutelCustomExperts(nn.Module):
    """A Tutel ``custom`` expert module (``forward(x_eND, ctx) -> y_eNO``) in moeflow's protocol.

    ``module`` holds the experts of *this process* (``local_count`` of them), as in Tutel where
    every rank builds its own local experts. ``num_experts`` starts at ``num_experts`` (the
    layer's global count, so ``moeflow.parallel.expert_parallel`` accepts the layer) and
    ``shard`` can only select this process's own block: it returns the same module with
    ``num_experts = local_count``. ``ctx`` is passed through to the module (Tutel passes the
    layer).
    """

    def __init__(self, module: nn.Module, *, num_experts: int, local_count: int, ctx: object = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"experts['module'] must build an nn.Module, got {type(module).__name__}")
        self.module = module
        self.num_experts = num_experts
        self.local_count = local_count
        object.__setattr__(self, "_ctx", ctx)  # the layer: not registered as a submodule (a cycle)
        mark_tutel_expert(self)

    def tutel_named_parameters(self):  # type: ignore[no-untyped-def]
        """The wrapped module's parameters under their own names (what Tutel scans)."""
        return self.module.named_parameters()

    def shard(self, start: int, count: int) -> "TutelCustomExperts":
        if count != self.local_count:
            raise ValueError(
                f"a custom Tutel expert module holds this rank's {self.local_count} experts; cannot shard {count}"
            )
        return TutelCustomExperts(self.module, num_experts=count, local_count=count, ctx=self._ctx)

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        e = self.local_count
        if self.num_experts != e:
            raise RuntimeError(
                f"this custom expert module holds {e} local experts but the layer routes {self.num_experts} here; "
                "with more than one rank the layer must be expert-parallel (pass group=)"
            )
        if expert_in.dim() == 3:
            return self.module(expert_in, self._ctx)
        # grouped rows -> [e, N, D] padded to the largest expert, then back
        R, D = expert_in.shape
        counts = counts_E.tolist()
        N = max(counts) if counts else 0
        if R == 0 or N == 0:
            out = self.module(expert_in.new_zeros(e, 1, D), self._ctx)
            return out.new_zeros(0, out.shape[-1]) + graph_zero(self, expert_in)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        expert_R = torch.repeat_interleave(torch.arange(e, device=expert_in.device), counts_E, output_size=R)
        slot_R = torch.arange(R, device=expert_in.device) - starts_E[expert_R]
        flat_R = expert_R * N + slot_R
        x_eND = expert_in.new_zeros(e * N, D).index_copy(0, flat_R, expert_in).view(e, N, D)
        y_eNO = self.module(x_eND, self._ctx)
        return y_eNO.reshape(e * N, -1).index_select(0, flat_R)


class TutelLlamaExperts(GroupedExperts):
    """Tutel's ``llama_ffn`` experts, ``(act(x W1) * (x W2)) W3`` (SwiGLU with ``act = silu``),
    as moeflow's ``GroupedExperts`` with ``activation="swiglu"`` and no biases.

    Layout (moeflow's): ``w_in [E, D, 2H]`` holds Tutel's ``W_fc1`` (gate, columns ``[0, H)``)
    then ``W_fc2`` (up, ``[H, 2H)``); ``w_out [E, H, D]`` is ``W_fc3``. A Tutel state dict
    (flat ``W_fc1``/``W_fc2``/``W_fc3`` of ``e*D*H`` values each, one process) loads as is: a
    load hook rewrites its keys. Initialised like Tutel, every weight ``N(0, 0.01^2)``.
    ``activation_fn`` (default ``silu``) replaces the gate's activation; only the default keeps
    moeflow's fused SwiGLU paths (Triton on GPU).
    """

    def __init__(
        self,
        *,
        num_experts: int,
        model_dim: int,
        hidden_size_per_expert: int,
        activation_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_experts=num_experts, dim=model_dim, hidden=hidden_size_per_expert,
                         config=ExpertsConfig(activation="swiglu", bias=False, init_std=0.01), device=device, dtype=dtype)
        if activation_fn is not None and not callable(activation_fn):
            raise TypeError(f"experts['activation_fn'] must be callable, got {type(activation_fn).__name__}")
        self.activation_fn = activation_fn if activation_fn is not None else F.silu
        self._register_load_state_dict_pre_hook(self._from_tutel_keys)
        mark_tutel_expert(self)

    def tutel_named_parameters(self):  # type: ignore[no-untyped-def]
        """The parameters under moeflow's names (``w_in``, ``w_out``; see the class docstring)."""
        return self.named_parameters()

    def _from_tutel_keys(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        names = [prefix + n for n in ("W_fc1", "W_fc2", "W_fc3")]
        if not all(n in state_dict for n in names):
            return
        e, D, H = self.num_experts, self.dim, self.hidden
        w1, w2, w3 = (state_dict.pop(n) for n in names)
        state_dict[prefix + "w_in"] = torch.cat([w1.reshape(e, D, H), w2.reshape(e, D, H)], dim=-1)
        state_dict[prefix + "w_out"] = w3.reshape(e, H, D)

    def _gated(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self.activation_fn(gate) * up

    @torch.no_grad()
    def shard(self, start: int, count: int) -> "TutelLlamaExperts":
        if not 0 <= start < start + count <= self.num_experts:
            raise ValueError(f"shard [{start}, {start + count}) is outside the {self.num_experts} experts")
        part = TutelLlamaExperts(num_experts=count, model_dim=self.dim, hidden_size_per_expert=self.hidden,
                                 activation_fn=self.activation_fn, device=self.w_in.device, dtype=self.w_in.dtype)
        for name, param in self.named_parameters():
            getattr(part, name).copy_(param[start : start + count])
        return part

    def _forward_padded(self, x_eCD: torch.Tensor) -> torch.Tensor:
        if self.activation_fn is F.silu:
            return super()._forward_padded(x_eCD)
        return torch.bmm(self._gated(torch.bmm(x_eCD, self.w_in)), self.w_out)

    def _forward_grouped(self, x_RD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if self.activation_fn is F.silu:
            return super()._forward_grouped(x_RD, counts_E)
        x_RD, w_in, w_out = autocast_cast(x_RD, x_RD, self.w_in, self.w_out)
        return grouped_ffn(x_RD, counts_E, w_in, w_out, activation=self._gated, backend=self.config.backend)
