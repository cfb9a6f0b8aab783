"""Configuration and validation (``moeflow.config``, the ``MoE`` constructor; no MoE compute).

Every bad value must fail where it is written, with an exception that names the field and shows
the value. Per-call overrides and input checks run before any routing, so they live here too.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import moeflow
from moeflow import DispatchConfig, ExpertsConfig, MoEConfig, RouterConfig

pytestmark = pytest.mark.unit

BASE = dict(dim=8, hidden=16, num_experts=4)

# (id, factory, exception type, substrings that must all appear in the message)
BAD_CONFIGS = [
    ("k0", lambda: MoEConfig(**BASE, top_k=0), ValueError, ["top_k", "0"]),
    ("k-neg", lambda: MoEConfig(**BASE, top_k=-2), ValueError, ["top_k", "-2"]),
    ("k>E", lambda: MoEConfig(**BASE, top_k=5), ValueError, ["top_k", "5", "num_experts=4"]),
    ("E0", lambda: MoEConfig(dim=8, hidden=16, num_experts=0, top_k=1), ValueError, ["num_experts", "0"]),
    ("dim0", lambda: MoEConfig(dim=0, hidden=16, num_experts=4), ValueError, ["dim", "0"]),
    ("hidden0", lambda: MoEConfig(dim=8, hidden=0, num_experts=4), ValueError, ["hidden", "0"]),
    ("k-bool", lambda: MoEConfig(**BASE, top_k=True), TypeError, ["top_k", "True"]),
    ("E-bool", lambda: MoEConfig(dim=8, hidden=16, num_experts=True, top_k=1), TypeError, ["num_experts", "True"]),
    ("dim-float", lambda: MoEConfig(dim=8.0, hidden=16, num_experts=4), TypeError, ["dim", "8.0"]),
    ("k-str", lambda: MoEConfig(**BASE, top_k="2"), TypeError, ["top_k", "'2'"]),
    ("cf-nan", lambda: MoEConfig(**BASE, capacity_factor=float("nan")), ValueError, ["capacity_factor", "nan"]),
    ("cf-inf", lambda: MoEConfig(**BASE, capacity_factor=float("inf")), ValueError, ["capacity_factor", "inf"]),
    ("cf-neginf", lambda: MoEConfig(**BASE, capacity_factor=-math.inf), ValueError, ["capacity_factor", "-inf"]),
    ("cf-str", lambda: MoEConfig(**BASE, capacity_factor="1.0"), TypeError, ["capacity_factor", "'1.0'"]),
    ("cf-bool", lambda: MoEConfig(**BASE, capacity_factor=True), TypeError, ["capacity_factor", "True"]),
    ("router-kind", lambda: RouterConfig(kind="dot"), ValueError, ["router kind", "'dot'"]),
    ("scoring", lambda: RouterConfig(scoring="relu"), ValueError, ["scoring", "'relu'"]),
    ("group-score", lambda: RouterConfig(group_score="mean"), ValueError, ["group_score", "'mean'"]),
    ("activation", lambda: ExpertsConfig(activation="tanh"), ValueError, ["activation", "'tanh'"]),
    ("backend", lambda: ExpertsConfig(backend="cutlass"), ValueError, ["backend", "'cutlass'"]),
    ("drop-policy", lambda: DispatchConfig(drop_policy="random"), ValueError, ["drop_policy", "'random'"]),
    ("weight-at", lambda: DispatchConfig(weight_at="both"), ValueError, ["weight_at", "'both'"]),
    ("tuner-type", lambda: moeflow.ParallelConfig(tuner=(1, 2)), TypeError, ["tuner", "(1, 2)"]),
    ("parallel-mode", lambda: moeflow.ParallelConfig(parallel="model"), ValueError, ["parallel", "'model'"]),
    ("overlap-degree-0", lambda: moeflow.ParallelConfig(overlap_degree=0), ValueError, ["overlap_degree", "0"]),
    ("overlap-with-data", lambda: moeflow.ParallelConfig(parallel="data", overlap_degree=2), ValueError,
     ["overlap_degree=2", "'data'"]),
    ("tuner-degrees-empty", lambda: moeflow.TunerConfig(degrees=()), ValueError, ["degrees", "()"]),
    ("tuner-degree-0", lambda: moeflow.TunerConfig(degrees=(1, 0)), ValueError, ["degrees", "0"]),
    ("tuner-degree-float", lambda: moeflow.TunerConfig(degrees=(1, 2.0)), TypeError, ["degrees", "2.0"]),
    ("tuner-max-trials", lambda: moeflow.TunerConfig(trials=5, max_trials=4), ValueError, ["max_trials", "4"]),
    ("tuner-close", lambda: moeflow.TunerConfig(close=1.0), ValueError, ["close", "1.0"]),
    ("tuner-retune", lambda: moeflow.TunerConfig(retune_ratio=0.5), ValueError, ["retune_ratio", "0.5"]),
    ("tuner-overlap-margin", lambda: moeflow.TunerConfig(overlap_margin=-0.1), ValueError, ["overlap_margin", "-0.1"]),
    ("tuner-min-time", lambda: moeflow.TunerConfig(min_time_s=float("nan")), ValueError, ["min_time_s", "nan"]),
    ("tuner-dict-bad", lambda: moeflow.ParallelConfig(tuner={"degree": (1,)}), TypeError, ["degree"]),
    (
        "normalize-topk-softmax",
        lambda: RouterConfig(scoring="topk_softmax", normalize_topk=True),
        ValueError,
        ["normalize_topk", "topk_softmax"],
    ),
    (
        "groups-not-dividing",
        lambda: MoEConfig(dim=8, hidden=16, num_experts=6, top_k=1, router=RouterConfig(num_groups=4, topk_groups=2)),
        ValueError,
        ["num_experts=6", "num_groups=4"],
    ),
    ("topk-groups>groups", lambda: RouterConfig(num_groups=2, topk_groups=3), ValueError, ["topk_groups", "3"]),
    (
        "k>group-limited",
        lambda: MoEConfig(dim=8, hidden=16, num_experts=8, top_k=5, router=RouterConfig(num_groups=4, topk_groups=2)),
        ValueError,
        ["top_k=5", "topk_groups=2"],
    ),
    (
        "top2-sum-one-per-group",
        lambda: MoEConfig(
            dim=8, hidden=16, num_experts=4, top_k=1, router=RouterConfig(num_groups=4, topk_groups=2, group_score="top2_sum")
        ),
        ValueError,
        ["top2_sum"],
    ),
    ("groups-bool", lambda: RouterConfig(num_groups=True), TypeError, ["num_groups", "True"]),
    ("groups0", lambda: RouterConfig(num_groups=0), ValueError, ["num_groups", "0"]),
    ("scaling0", lambda: RouterConfig(routed_scaling_factor=0.0), ValueError, ["routed_scaling_factor", "0.0"]),
    ("scaling-nan", lambda: RouterConfig(routed_scaling_factor=float("nan")), ValueError, ["routed_scaling_factor", "nan"]),
    ("noise-neg", lambda: RouterConfig(noise_std=-0.1), ValueError, ["noise_std", "-0.1"]),
    ("jitter-1", lambda: RouterConfig(jitter_eps=1.0), ValueError, ["jitter_eps", "1.0"]),
    ("dropout-1", lambda: RouterConfig(input_dropout=1.0), ValueError, ["input_dropout", "1.0"]),
    (
        "cosine-temps",
        lambda: RouterConfig(cosine_init_temperature=0.1, cosine_min_temperature=0.2),
        ValueError,
        ["cosine_min_temperature", "0.2", "0.1"],
    ),
    ("lb-coef-neg", lambda: RouterConfig(load_balance_coef=-0.01), ValueError, ["load_balance_coef", "-0.01"]),
    ("z-coef-inf", lambda: RouterConfig(z_loss_coef=math.inf), ValueError, ["z_loss_coef", "inf"]),
    ("bias-rate-neg", lambda: RouterConfig(bias_update_rate=-1e-3), ValueError, ["bias_update_rate", "-0.001"]),
    ("router-dtype-int", lambda: RouterConfig(dtype=torch.int32), TypeError, ["dtype", "torch.int32"]),
    ("router-dtype-str", lambda: RouterConfig(dtype="float32"), TypeError, ["dtype", "'float32'"]),
    ("init-std-neg", lambda: ExpertsConfig(init_std=-1.0), ValueError, ["init_std", "-1.0"]),
    ("shared-neg", lambda: MoEConfig(**BASE, num_shared_experts=-1), ValueError, ["num_shared_experts", "-1"]),
    ("shared-hidden-no-shared", lambda: MoEConfig(**BASE, shared_hidden=32), ValueError, ["shared_hidden"]),
    ("shared-gate-no-shared", lambda: MoEConfig(**BASE, shared_gate=True), ValueError, ["shared_gate"]),
    ("router-dict", lambda: MoEConfig(**BASE, router={"kind": "linear"}), TypeError, ["router", "RouterConfig"]),
    ("dispatch-none", lambda: MoEConfig(**BASE, dispatch=None), TypeError, ["dispatch", "DispatchConfig"]),
]


@pytest.mark.parametrize("factory, exc, needles", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_raises_naming_field_and_value(factory, exc, needles):
    with pytest.raises(exc) as info:
        factory()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} missing from {message!r}"


@pytest.mark.parametrize(
    "make",
    [
        lambda: RouterConfig(),
        lambda: DispatchConfig(),
        lambda: moeflow.TunerConfig(),
        lambda: ExpertsConfig(),
        lambda: MoEConfig(**BASE),
    ],
    ids=["router", "dispatch", "tuner", "experts", "moe"],
)
def test_configs_are_frozen_and_keyword_only(make):
    cfg = make()
    field = dataclasses.fields(cfg)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field, getattr(cfg, field))
    with pytest.raises(TypeError):
        type(cfg)(*[getattr(cfg, f.name) for f in dataclasses.fields(cfg)])


def test_good_configs_construct():
    cfg = MoEConfig(
        dim=8,
        hidden=16,
        num_experts=8,
        top_k=4,
        capacity_factor=-0.5,
        router=RouterConfig(kind="cosine", scoring="sigmoid", normalize_topk=True, num_groups=4, topk_groups=2, group_score="top2_sum"),
        dispatch=DispatchConfig(drop_policy="bpr", weight_at="dispatch", renormalize_after_drop=True),
        experts=ExpertsConfig(activation="geglu", bias=True, backend="loop"),
        num_shared_experts=2,
        shared_gate=True,
    )
    assert cfg.top_k == 4 and cfg.capacity_factor == -0.5
    assert cfg.shared_width == 2 * 16
    assert MoEConfig(**BASE, num_shared_experts=1, shared_hidden=5).shared_width == 5
    assert ExpertsConfig(activation="swiglu").gated and not ExpertsConfig(activation="gelu").gated
    # 0 and negative capacity factors are values, not errors
    assert MoEConfig(**BASE, capacity_factor=0).capacity_factor == 0
    assert MoEConfig(**BASE, capacity_factor=-2.0).capacity_factor == -2.0
    # top_k == E is allowed
    assert MoEConfig(**BASE, top_k=4).top_k == 4
    # the tuner's settings: lists become tuples, dicts (JSON) become TunerConfig
    assert moeflow.TunerConfig(degrees=[1, 8]).degrees == (1, 8)
    tuned = moeflow.ParallelConfig(parallel="auto", tuner={"degrees": [1, 3], "trials": 2, "close": 0.0})
    assert tuned.tuner == moeflow.TunerConfig(degrees=(1, 3), trials=2, close=0.0)
    assert moeflow.ParallelConfig(**dataclasses.asdict(tuned)) == tuned


def test_parallel_settings_in_dispatch_config_are_deprecated_but_work():
    """``DispatchConfig(parallel=, overlap_degree=, tuner=)`` moved to ``ParallelConfig``: for one
    release they still validate and become the layer's expert-parallel defaults, with a
    DeprecationWarning; a plain DispatchConfig warns about nothing."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = DispatchConfig(drop_policy="score")
    assert plain.parallel_defaults() == moeflow.ParallelConfig()
    with pytest.warns(DeprecationWarning, match="ParallelConfig"):
        old = DispatchConfig(parallel="auto", tuner={"degrees": [1, 3], "trials": 2, "close": 0.0})
    assert old.parallel_defaults() == moeflow.ParallelConfig(
        parallel="auto", tuner=moeflow.TunerConfig(degrees=(1, 3), trials=2, close=0.0))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="overlap_degree"):
        DispatchConfig(overlap_degree=0)


# ----------------------------------------------------------------------------- MoE constructor


def test_moe_bad_kwargs_raise():
    with pytest.raises(ValueError, match="top_k"):
        moeflow.MoE(dim=8, hidden=16, num_experts=4, top_k=5)
    with pytest.raises(TypeError, match="hiden"):
        moeflow.MoE(dim=8, hiden=16, num_experts=4)
    with pytest.raises(ValueError, match="capacity_factor"):
        moeflow.MoE(dim=8, hidden=16, num_experts=4, capacity_factor=float("nan"))
    cfg = MoEConfig(**BASE)
    with pytest.raises(ValueError, match="top_k"):
        moeflow.MoE(config=cfg, top_k=9)  # override of a ready config is validated too
    with pytest.raises(TypeError):
        moeflow.MoE(config=cfg, not_a_field=1)
    with pytest.raises(TypeError, match="MoEConfig"):
        moeflow.MoE(config={"dim": 8})
    with pytest.raises(TypeError):
        moeflow.MoE(**BASE, experts_module=nn.Linear(8, 8))  # no num_experts attribute


def test_moe_config_override_applies():
    cfg = MoEConfig(**BASE, top_k=1)
    layer = moeflow.MoE(config=cfg, top_k=3, capacity_factor=0.0)
    assert layer.config.top_k == 3 and layer.config.capacity_factor == 0.0
    assert cfg.top_k == 1  # the original config is untouched


def test_module_experts_count_must_match():
    mods = [nn.Linear(8, 8) for _ in range(3)]
    with pytest.raises(ValueError, match="3"):
        moeflow.MoE(**BASE, experts_module=moeflow.ModuleExperts(mods))
    with pytest.raises(ValueError):
        moeflow.ModuleExperts([])
    with pytest.raises(TypeError, match=r"modules\[1\]"):
        moeflow.ModuleExperts([nn.Linear(8, 8), "not a module"])


# ----------------------------------------------------------------------------- per call + inputs


@pytest.fixture
def small_layer():
    torch.manual_seed(0)
    return moeflow.MoE(dim=8, hidden=16, num_experts=4, top_k=2, dtype=torch.float64).eval()


def _x(T=5, D=8, dtype=torch.float64):
    return torch.randn(T, D, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"top_k": 0}, ValueError, "top_k"),
        ({"top_k": 5}, ValueError, "top_k"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_k": True}, TypeError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"capacity_factor": float("nan")}, ValueError, "capacity_factor"),
        ({"capacity_factor": float("inf")}, ValueError, "capacity_factor"),
        ({"capacity_factor": "0"}, TypeError, "capacity_factor"),
    ],
    ids=["k0", "k>E", "k-neg", "k-bool", "k-float", "cf-nan", "cf-inf", "cf-str"],
)
def test_per_call_override_validated(small_layer, kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        small_layer(_x(), **kwargs)


def test_per_call_top_k_checked_against_group_limit():
    layer = moeflow.MoE(
        dim=8, hidden=16, num_experts=8, top_k=2, router=RouterConfig(num_groups=4, topk_groups=2), dtype=torch.float64
    )
    layer(_x(), top_k=4)  # 2 groups x 2 experts: 4 is the most group limiting leaves
    with pytest.raises(ValueError, match="top_k=5"):
        layer(_x(), top_k=5)


def test_input_checks(small_layer):
    with pytest.raises(ValueError, match="dim=8") as info:
        small_layer(_x(D=7))
    assert "7" in str(info.value)
    with pytest.raises(ValueError, match="dim=8"):
        small_layer(torch.tensor(1.0, dtype=torch.float64))  # 0-d
    with pytest.raises(TypeError, match="floating"):
        small_layer(torch.ones(5, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="float32"):
        small_layer(_x(dtype=torch.float32))  # layer is float64
    with pytest.raises(TypeError, match="Tensor"):
        small_layer([[1.0] * 8])
    with pytest.raises(ValueError, match="x is on meta but the layer parameters are on cpu"):
        small_layer(torch.empty(5, 8, dtype=torch.float64, device="meta"))  # would return uninitialised memory


@pytest.mark.parametrize("kwargs, exc, needle", [
    (dict(dtype=torch.int64), TypeError, "dtype must be a floating-point torch.dtype or None, got torch.int64"),
    (dict(dtype="float32"), TypeError, "got 'float32'"),
    (dict(device="nonsense"), ValueError, "device must name a torch device .* got 'nonsense'"),
])
def test_constructor_dtype_and_device_checked(kwargs, exc, needle):
    with pytest.raises(exc, match=needle):
        moeflow.MoE(**BASE, **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_check_finite(bad):
    torch.manual_seed(0)
    x = _x()
    x[3, 2] = bad
    layer = moeflow.MoE(**BASE, check_finite=True, dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite"):
        layer(x)
    layer(_x())  # finite input passes
    off = moeflow.MoE(**BASE, dtype=torch.float64)  # off by default: no error, the value propagates
    y = off(x)
    assert y.shape == x.shape
    assert torch.isfinite(y[:3]).all() and torch.isfinite(y[4:]).all()


def test_one_vocabulary_of_activations():
    """The activation names are spelled once (``moeflow.kernels.activation``): the config's
    ``Literal`` is that one, ``ExpertsConfig`` takes exactly those names (gated exactly for
    ``GATED``), the CLI's ``--activation`` choices are those names, and the Triton kernels'
    table of codes (which cannot import them: ``moeflow.kernels.triton`` imports nothing from
    above it) holds exactly them, with the same gated ones."""
    import argparse
    import typing

    import moeflow.config
    from moeflow.cli.main import build_parser
    from moeflow.kernels.activation import ACTIVATIONS, GATED, Activation

    assert moeflow.config.Activation is Activation and typing.get_args(Activation) == ACTIVATIONS
    assert set(GATED) < set(ACTIVATIONS) and len(set(ACTIVATIONS)) == len(ACTIVATIONS) == 6
    # appended, never inserted: the layer matrix samples its configurations in this order
    assert ACTIVATIONS[:5] == ("relu", "gelu", "silu", "swiglu", "geglu") and ACTIVATIONS[-1] == "swiglu_oai"
    for name in ACTIVATIONS:
        assert ExpertsConfig(activation=name).gated == (name in GATED)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    choices = next(a.choices for a in sub.choices["bench"]._actions if "--activation" in a.option_strings)
    assert tuple(choices) == ACTIVATIONS
    pytest.importorskip("triton")
    from moeflow.kernels.triton.activation import ACT_CODES
    from moeflow.kernels.triton.grouped_gemm_kernels import TRITON_ACTIVATIONS

    assert ACT_CODES is TRITON_ACTIVATIONS and sorted(TRITON_ACTIVATIONS) == sorted(ACTIVATIONS)
    assert {name for name, (_, gated) in TRITON_ACTIVATIONS.items() if gated} == GATED
    # the kernels' codes of the elementwise functions: a gated kind shares its function's code
    assert TRITON_ACTIVATIONS["swiglu"][0] == TRITON_ACTIVATIONS["silu"][0]
    assert TRITON_ACTIVATIONS["geglu"][0] == TRITON_ACTIVATIONS["gelu"][0]
    # swiglu_oai's gate function is its own, with the constants the torch ops use
    from moeflow.kernels.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
    from moeflow.kernels.triton import grouped_gemm_kernels as kernels

    assert TRITON_ACTIVATIONS["swiglu_oai"][0] not in {code for name, (code, _) in TRITON_ACTIVATIONS.items()
                                                       if name != "swiglu_oai"}
    assert (kernels.SWIGLU_OAI_ALPHA.value, kernels.SWIGLU_OAI_LIMIT.value) == (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
