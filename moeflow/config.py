"""Frozen keyword-only configuration dataclasses, validated on construction.

Every knob of the layer lives here, so a bad value fails where it is written, with the name of
the field and the value, instead of deep inside a forward pass.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch

from moeflow.checks import (  # noqa: F401  (re-exported: importers use moeflow.config)
    ParallelMode, _choice, _float, _int, _parallel_mode, check_capacity_factor, check_overlap_degree,
    check_parallel_mode, check_top_k, hybrid_shards,
)
from moeflow.kernels.activation import GATED, Activation  # the one vocabulary of activation names

__all__ = [
    "RouterConfig",
    "DispatchConfig",
    "TunerConfig",
    "ParallelConfig",
    "ExpertsConfig",
    "MoEConfig",
    "RouterKind",
    "Scoring",
    "DropPolicy",
    "Activation",
]

RouterKind = Literal["linear", "cosine"]
Scoring = Literal["softmax", "topk_softmax", "sigmoid"]
GroupScore = Literal["max", "top2_sum"]
DropPolicy = Literal["position", "score", "bpr"]
WeightAt = Literal["combine", "dispatch"]
ExpertsBackend = Literal["auto", "grouped_mm", "loop", "triton"]
FP8Recipe = Literal["rowwise"]
FP8Gemm = Literal["scaled_grouped_mm", "reference"]


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How tokens pick experts, how exploration noise is added, and which balance losses run.

    Scoring:
        ``"softmax"``: softmax over all experts, then top-k of the probabilities; with
        ``normalize_topk`` the k selected weights are rescaled to sum to 1 (Switch/GShard/Qwen).
        ``"topk_softmax"``: top-k of the logits, then softmax over the k selected (Mixtral);
        the weights always sum to 1, so ``normalize_topk`` must stay False.
        ``"sigmoid"``: sigmoid scores, top-k, then (with ``normalize_topk``) divide by the sum of
        the selected scores (DeepSeek-V3).
        In every case the weights are multiplied by ``routed_scaling_factor`` at the end.

    Group-limited routing (``num_groups > 1``): experts are split into ``num_groups`` equal
    groups, each group is scored by its best expert (``group_score="max"``, DeepSeek-V2) or the
    sum of its best two (``"top2_sum"``, DeepSeek-V3), only the best ``topk_groups`` groups stay
    eligible, and top-k is taken inside them.

    Exploration (training mode only): ``noise_std`` adds N(0, noise_std^2) to the logits;
    ``jitter_eps`` multiplies the router input by U(1-eps, 1+eps) (Switch); ``input_dropout``
    applies dropout to the router input.

    Balance: ``load_balance_coef`` (GShard/Switch ``E * sum_e f_e P_e``), ``importance_coef`` and
    ``load_coef`` (Shazeer et al. 2017, squared coefficient of variation; the load term uses the
    smooth normal-CDF estimator when noise is active and the hard assignment counts otherwise),
    ``z_loss_coef`` (ST-MoE router z-loss). ``bias_update_rate > 0`` turns on aux-loss-free
    balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only, updated
    by ``moeflow.update_expert_bias`` from the load counted since the last update.

    ``dtype``: the dtype the router computes in. ``None`` means the input dtype promoted to at
    least float32 (bf16/fp16 models get an fp32 router, fp64 stays fp64).
    """

    kind: RouterKind = "linear"
    scoring: Scoring = "softmax"
    normalize_topk: bool = False
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = "max"
    bias: bool = False
    noise_std: float = 0.0
    jitter_eps: float = 0.0
    input_dropout: float = 0.0
    cosine_proj_dim: int = 256
    cosine_init_temperature: float = 0.5
    cosine_min_temperature: float = 0.01
    load_balance_coef: float = 0.01
    importance_coef: float = 0.0
    load_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _choice("router kind", self.kind, RouterKind)
        _choice("scoring", self.scoring, Scoring)
        _choice("group_score", self.group_score, GroupScore)
        if self.scoring == "topk_softmax" and self.normalize_topk:
            raise ValueError(
                "normalize_topk=True has no effect with scoring='topk_softmax' (its weights already "
                "sum to 1); leave it False"
            )
        _float("routed_scaling_factor", self.routed_scaling_factor)
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        _int("num_groups", self.num_groups, minimum=1)
        _int("topk_groups", self.topk_groups, minimum=1)
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups must be <= num_groups={self.num_groups}, got {self.topk_groups}")
        _float("noise_std", self.noise_std, minimum=0.0)
        _float("jitter_eps", self.jitter_eps, minimum=0.0, below=1.0)
        _float("input_dropout", self.input_dropout, minimum=0.0, below=1.0)
        _int("cosine_proj_dim", self.cosine_proj_dim, minimum=1)
        _float("cosine_init_temperature", self.cosine_init_temperature)
        _float("cosine_min_temperature", self.cosine_min_temperature)
        if not 0 < self.cosine_min_temperature <= self.cosine_init_temperature:
            raise ValueError(
                "need 0 < cosine_min_temperature <= cosine_init_temperature, got "
                f"{self.cosine_min_temperature} and {self.cosine_init_temperature}"
            )
        for name in ("load_balance_coef", "importance_coef", "load_coef", "z_loss_coef", "bias_update_rate"):
            _float(name, getattr(self, name), minimum=0.0)
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise TypeError(f"router dtype must be a floating torch.dtype or None, got {self.dtype!r}")

    def validate_for(self, *, num_experts: int, top_k: int) -> None:
        """Checks that depend on the layer shape (run by ``MoEConfig`` and per call)."""
        if num_experts % self.num_groups:
            raise ValueError(f"num_experts={num_experts} must be divisible by num_groups={self.num_groups}")
        per_group = num_experts // self.num_groups
        if top_k > self.topk_groups * per_group:
            raise ValueError(
                f"top_k={top_k} exceeds the experts left by group-limited routing "
                f"(topk_groups={self.topk_groups} x {per_group} experts per group)"
            )
        if self.group_score == "top2_sum" and self.num_groups > 1 and per_group < 2:
            raise ValueError("group_score='top2_sum' needs at least 2 experts per group")


@dataclass(frozen=True, kw_only=True)
class TunerConfig:
    """How ``"auto"`` (``parallel`` / ``overlap_degree``) times its candidates, per global batch
    size, on real calls (``moeflow.parallel.placement.tuner``).

    ``degrees``: the overlap degrees tried in the expert-parallel mode. Each candidate gets one
    warm-up call, then ``trials`` timed calls, more (up to ``max_trials``) while its trials add
    up to less than ``min_time_s``; medians decide. Candidates whose median is within ``close``
    of the fastest one's are a near tie: they alone are timed on to ``max_trials`` each.
    ``retune_ratio``: tune again when the routing's load imbalance (busiest expert over the
    mean) moves by more than this factor from the one the choice was made under.
    ``overlap_margin``: a degree above 1 wins only when its median beats the same mode's degree
    1 by more than this fraction: pipelining hides at most the exchange, so where that is small
    its gain is noise while its chunks' fixed costs stay.
    """

    degrees: tuple[int, ...] = (1, 2, 4)
    trials: int = 3
    max_trials: int = 12
    min_time_s: float = 0.05
    close: float = 0.1
    retune_ratio: float = 1.5
    overlap_margin: float = 0.03

    def __post_init__(self) -> None:
        if isinstance(self.degrees, (list, tuple)):
            object.__setattr__(self, "degrees", tuple(self.degrees))
        if not isinstance(self.degrees, tuple) or not self.degrees:
            raise ValueError(f"degrees must be a non-empty tuple of ints >= 1, got {self.degrees!r}")
        for d in self.degrees:
            _int("degrees", d, minimum=1)
        _int("trials", self.trials, minimum=1)
        _int("max_trials", self.max_trials, minimum=self.trials)
        _float("min_time_s", self.min_time_s, minimum=0.0)
        _float("close", self.close, minimum=0.0, below=1.0)
        _float("retune_ratio", self.retune_ratio, minimum=1.0)
        _float("overlap_margin", self.overlap_margin, minimum=0.0, below=1.0)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How an expert-parallel dispatcher runs its calls (``moeflow.parallel.expert_parallel(...,
    config=)``); every call may override ``parallel`` and ``overlap_degree``
    (``layer(x, parallel="data")``). Results never depend on these settings (beyond rounding),
    only speed does.

    ``parallel``: ``"expert"`` (tokens travel to the ranks holding their experts), ``"data"``
    (tokens stay; the expert weights are all-gathered for the call and their gradients summed
    back onto the shards: cheaper when tokens are few), ``"sharded"`` (every rank computes a
    1/W slice of every expert's hidden dimension for all the group's kept rows, whose partial
    outputs are summed back onto their ranks: the work is even however skewed the routing),
    ``"hybrid:r"`` (every expert split into ``r`` hidden slices on ``r`` different ranks for the
    call, the layout of ``expert_parallel(hidden_shards=r)``: Tutel's ``adaptive_r``), or
    ``"auto"`` (timed on the first calls of each batch size together with the overlap degrees;
    the fastest is kept).
    ``overlap_degree``: in the expert mode, split the exchange into this many chunks of every
    rank's local experts (``moeflow.parallel.strategies.pipeline``: each expert's GEMM keeps all
    its rows; with one expert per rank, of its tokens) so that one chunk's expert compute runs
    while the next chunk is exchanged, forward
    and backward; ``"auto"`` times ``tuner.degrees``.
    ``tuner``: how ``"auto"`` times its candidates (``TunerConfig``; a dict of its fields is
    accepted, as JSON configs give it).
    """

    parallel: ParallelMode = "expert"
    overlap_degree: int | str = 1
    tuner: TunerConfig = field(default_factory=TunerConfig)

    def __post_init__(self) -> None:
        if isinstance(self.tuner, dict):
            object.__setattr__(self, "tuner", TunerConfig(**self.tuner))
        if not isinstance(self.tuner, TunerConfig):
            raise TypeError(f"tuner must be a TunerConfig, got {type(self.tuner).__name__} {self.tuner!r}")
        _parallel_mode(self.parallel)
        check_overlap_degree(self.overlap_degree)
        if hybrid_shards(self.parallel) is not None or self.parallel in ("data", "sharded"):
            if self.overlap_degree != 1:
                raise ValueError(f"overlap_degree={self.overlap_degree!r} applies to parallel='expert' or 'auto', "
                                 f"not {self.parallel!r}")


_MOVED_TO_PARALLEL = ("parallel", "overlap_degree", "tuner")


@dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """How routed assignments become expert rows and come back.

    ``drop_policy`` orders the assignments competing for an expert's ``C`` slots:
        ``"position"``: all first choices before all second choices, tokens in batch order
        (GShard/Tutel);
        ``"score"``: highest router weight first over all assignments (ties by position);
        ``"bpr"``: batch-prioritized routing (V-MoE): choice by choice, tokens ordered by their
        highest router weight.
    ``weight_at``: multiply the expert *output* by the router weight (``"combine"``, the usual
    choice) or the expert *input* (``"dispatch"``, Llama-4 style).
    ``renormalize_after_drop``: when an assignment is dropped, rescale the token's kept weights
    so they sum to the same total as all k weights did (default False: dropped assignments just
    contribute nothing, as in GShard and Switch).

    Deprecated (one release): ``parallel``, ``overlap_degree`` and ``tuner`` moved to
    ``ParallelConfig``, which ``moeflow.parallel.expert_parallel`` takes. Set here they still
    work, with a ``DeprecationWarning``: ``expert_parallel`` without a config uses them.
    """

    drop_policy: DropPolicy = "position"
    weight_at: WeightAt = "combine"
    renormalize_after_drop: bool = False
    parallel: ParallelMode | None = None
    overlap_degree: int | str | None = None
    tuner: TunerConfig | None = None

    def __post_init__(self) -> None:
        _choice("drop_policy", self.drop_policy, DropPolicy)
        _choice("weight_at", self.weight_at, WeightAt)
        moved = {name: getattr(self, name) for name in _MOVED_TO_PARALLEL if getattr(self, name) is not None}
        if moved:
            warnings.warn(
                f"DispatchConfig({', '.join(f'{k}=...' for k in moved)}) is deprecated: pass "
                "moeflow.ParallelConfig(...) to moeflow.parallel.expert_parallel(model, config=...) instead",
                DeprecationWarning, stacklevel=3,
            )
            if isinstance(self.tuner, dict):
                object.__setattr__(self, "tuner", TunerConfig(**self.tuner))
            self.parallel_defaults()  # validated as ParallelConfig would, so a bad value fails here

    def parallel_defaults(self) -> ParallelConfig:
        """The deprecated ``parallel``/``overlap_degree``/``tuner`` fields as a
        ``ParallelConfig`` (its defaults where unset)."""
        moved = {name: getattr(self, name) for name in _MOVED_TO_PARALLEL if getattr(self, name) is not None}
        return ParallelConfig(**moved)


@dataclass(frozen=True, kw_only=True)
class ExpertsConfig:
    """The routed expert FFNs: ``act(x W_in + b_in) W_out + b_out``, 3-D weights ``[E, ...]``.

    Gated activations (``"swiglu"``, ``"geglu"``, ``"swiglu_oai"``) use ``act(x W_gate) * (x W_up)``
    (``"swiglu_oai"``: gpt-oss's clamped SwiGLU, ``moeflow.kernels.activation``); the gate and
    up projections are stored fused in ``w_in [E, D, 2H]`` (gate first).
    ``backend`` picks the grouped GEMM used in dropless mode: ``"grouped_mm"``
    (``torch.nn.functional.grouped_mm``), ``"loop"`` (one matmul per expert, the reference),
    ``"triton"`` (``moeflow.kernels.triton``: the FFN with its activation fused; CUDA, or CPU
    under the Triton interpreter for tests), or ``"auto"`` (Triton for bf16/fp16 on CUDA,
    ``grouped_mm`` where it supports the device and dtype, else ``loop``).
    ``recompute``: keep only the experts' input rows for backward and recompute the hidden
    activation there (Megatron-Core's MoE recompute): the same gradients, less activation
    memory, one more GEMM per expert in backward (``moeflow.experts.lean``).
    ``recompute_chunks``: with ``recompute``, at most this many expert chunks that forward and
    backward run over (None: about 8, sized from the hidden activation). Fewer chunks are fewer,
    larger kernel calls (faster on a CPU shared with other work) at a higher backward peak; the
    gradients do not depend on it.
    ``fp8``: ``"rowwise"`` runs the experts' grouped GEMMs, forward and backward, in e4m3 with an
    fp32 scale per operand row (``moeflow.experts.fp8``), quantising the weights (kept in their
    dtype, as the optimizer state) each call; None: no FP8. Needs CUDA capability 8.9+ with
    ``torch._scaled_grouped_mm`` (else a clear error at the first forward), no biases, no
    ``recompute``, ``dim``/``hidden`` multiples of 16 (``backend`` unused). Row-wise only: torch
    2.11's grouped FP8 GEMM on Hopper takes no 128-block scales. ``fp8_gemm``: the fast CUDA
    path (default) or ``"reference"`` (products dequantised to fp32, any device: the CPU tests).
    """

    activation: Activation = "swiglu"
    bias: bool = False
    backend: ExpertsBackend = "auto"
    init_std: float = 0.02
    recompute: bool = False
    recompute_chunks: int | None = None
    fp8: FP8Recipe | None = None
    fp8_gemm: FP8Gemm = "scaled_grouped_mm"

    def __post_init__(self) -> None:
        _choice("activation", self.activation, Activation)
        if self.fp8 is not None:
            _choice("fp8", self.fp8, FP8Recipe)
            if self.bias:
                raise ValueError(f"fp8={self.fp8!r} needs experts without biases (bias=False), got bias=True")
            if self.recompute:
                raise ValueError(f"fp8={self.fp8!r} does not combine with recompute=True (its backward saves the rows)")
        _choice("fp8_gemm", self.fp8_gemm, FP8Gemm)
        if self.fp8 is None and self.fp8_gemm != "scaled_grouped_mm":
            raise ValueError(f"fp8_gemm={self.fp8_gemm!r} applies with fp8 set (e.g. fp8='rowwise'), got fp8=None")
        _choice("experts backend", self.backend, ExpertsBackend)
        _float("init_std", self.init_std, minimum=0.0)
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute must be a bool, got {self.recompute!r}")
        if self.recompute_chunks is not None:
            if isinstance(self.recompute_chunks, bool) or not isinstance(self.recompute_chunks, int):
                raise TypeError(f"recompute_chunks must be an int or None, got {self.recompute_chunks!r}")
            if self.recompute_chunks < 1:
                raise ValueError(f"recompute_chunks must be >= 1, got {self.recompute_chunks}")
            if not self.recompute:
                raise ValueError(f"recompute_chunks={self.recompute_chunks} applies with recompute=True")

    @property
    def gated(self) -> bool:
        return self.activation in GATED


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Everything that defines one ``moeflow.MoE`` layer.

    Capacity (``capacity_factor`` = cf, overridable per call; 0 is a value):
        cf > 0: ``C = ceil(cf * T * K / E)`` computed exactly on the decimal value of cf, then
        clipped to ``T`` (an expert can never receive more than T assignments); assignments past
        C are dropped in ``drop_policy`` order; the experts run as a batched matmul on
        ``[E, C, D]``.
        cf == 0: dropless; grouped GEMM over exactly the routed rows, no padding.
        cf < 0: dropless but capped at ``ceil(|cf| * T * K / E)`` rows per expert.

    ``load_window``: keep the per-expert assignment counts of the last ``load_window`` training
    calls (``MoE.load_stats()``; 0 = off). The counts stay on the device (no host sync).
    """

    dim: int
    hidden: int
    num_experts: int
    top_k: int = 2
    capacity_factor: float = 1.0
    router: RouterConfig = field(default_factory=RouterConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    num_shared_experts: int = 0
    shared_hidden: int | None = None
    shared_gate: bool = False
    check_finite: bool = False
    load_window: int = 0

    def __post_init__(self) -> None:
        _int("dim", self.dim, minimum=1)
        _int("hidden", self.hidden, minimum=1)
        _int("num_experts", self.num_experts, minimum=1)
        _int("top_k", self.top_k, minimum=1)
        check_top_k(self.top_k, self.num_experts)
        check_capacity_factor(self.capacity_factor)
        for name, typ in (("router", RouterConfig), ("dispatch", DispatchConfig), ("experts", ExpertsConfig)):
            if not isinstance(getattr(self, name), typ):
                raise TypeError(f"{name} must be a {typ.__name__}, got {type(getattr(self, name)).__name__}")
        self.router.validate_for(num_experts=self.num_experts, top_k=self.top_k)
        _int("num_shared_experts", self.num_shared_experts, minimum=0)
        if self.shared_hidden is not None:
            _int("shared_hidden", self.shared_hidden, minimum=1)
            if self.num_shared_experts == 0:
                raise ValueError("shared_hidden is set but num_shared_experts=0")
        if self.shared_gate and self.num_shared_experts == 0:
            raise ValueError("shared_gate=True needs num_shared_experts >= 1")
        _int("load_window", self.load_window, minimum=0)

    @property
    def shared_width(self) -> int:
        """Hidden width of the fused shared-expert FFN (``num_shared_experts * hidden`` by default)."""
        return self.shared_hidden if self.shared_hidden is not None else self.num_shared_experts * self.hidden
