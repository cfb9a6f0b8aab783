"""The FFN of each public MoE family as moeflow's: Hugging Face ``config.json`` fields to and
from the FFN fields of a ``GPTConfig``, and a block's FFN tensors to and from moeflow's names
(the one place the family converters and the tests take them from). What transformers' blocks
compute (``FAMILIES``, by ``model_type``):

    mixtral      softmax over the experts, top-k, renormalised (= softmax over the top-k logits)
    qwen2_moe    softmax, top-k, renormalised with norm_topk_prob; one shared expert scaled by
                 sigmoid(shared_expert_gate(x)); dense blocks: mlp_only_layers, decoder_sparse_step
    qwen3_moe    as qwen2_moe without the shared expert;  olmoe: as qwen3_moe, every block MoE
    deepseek_v3  sigmoid scores, group-limited top-k (groups ranked by their best two), the
                 e_score_correction_bias added for the choice only, renormalised with
                 norm_topk_prob, times routed_scaling_factor; shared experts without a gate; the
                 first first_k_dense_replace blocks dense
    gpt_oss      router with a bias, softmax over the top-k logits; experts with biases and the
                 clamped SwiGLU (``swiglu_oai``)

``moe_fields_from_hf(hf)``: the ``GPTConfig`` keyword arguments ``FFN_FIELDS``, refusing with a
``ValueError`` naming the field and value what moeflow cannot express; ``MOE_KEYS[family]``:
the fields it reads (``MOE_IGNORED``: those it leaves alone, and why; every other field is the
family converter's). ``moe_fields_to_hf(family, cfg)``: the inverse, checked by mapping back.

Router dtype: transformers computes DeepSeek-V3's router in fp32 whatever the model's dtype,
so its ``RouterConfig.dtype`` is ``torch.float32`` (the same numbers in every dtype). The others
take the logits in the model's dtype (Mixtral, Qwen, OLMoE: the softmax in fp32); their
``dtype`` stays ``None`` (the input's, at least fp32): exact for fp32 models; for bf16 ones the
logits are rounded less than transformers' (a near-tie may choose another expert); for fp64
ones the softmax is fp64 where transformers' is fp32.

``router_aux_loss_coef`` becomes ``load_balance_coef``: the coefficient, not transformers' loss
(added only with ``output_router_logits``, over all blocks' tokens at once, with assignment
fractions summing to k; moeflow's is per block, fractions summing to 1). DeepSeek-V3's
``e_score_correction_bias`` is ``router.expert_bias``, which the choice uses when
``bias_update_rate > 0``: set to DeepSeek-V3's published speed 0.001, so training goes on
balancing as its pre-training did (``update_expert_bias``; any rate > 0 keeps the bias).

Tensors (``ffn_from_hf`` / ``ffn_to_hf``, per block): moeflow's ``w_in [E, D, 2H]`` holds gate
columns then up columns, ``w_out [E, H, D]``; ``DenseFFN``'s ``proj_in.weight [2H, D]`` gate rows
then up rows. The files (published, and what ``save_pretrained`` writes) keep one ``F.linear``
weight per expert (``experts.{e}.gate_proj [H, D]``, Mixtral's ``w1``/``w3``/``w2``);
transformers' fused in-memory layout (``experts.gate_up_proj [E, 2H, D]``) is read too. gpt-oss
keeps ``gate_up_proj [E, D, 2H]`` with gate and up columns interleaved (gate at even columns).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from moeflow.config import ExpertsConfig, RouterConfig
from moeflow.kernels.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from moeflow.models.gpt_config import GPTConfig

__all__ = ["FAMILIES", "FFN_FIELDS", "MOE_KEYS", "MOE_IGNORED", "moe_fields_from_hf", "moe_fields_to_hf",
           "hf_ffn_shapes", "ffn_from_hf", "ffn_to_hf"]

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
FFN_FIELDS = ("num_experts", "top_k", "expert_hidden", "capacity_factor", "router", "experts", "num_shared_experts",
              "shared_hidden", "shared_gate", "moe_every", "dense_layers", "dense_hidden")
# per family: the expert count's names (the one written first; transformers' attribute_map
# aliases), the routed experts' width, and the other fields read (MOE_KEYS)
_EXPERTS = {"mixtral": ("num_local_experts", "num_experts"), "qwen2_moe": ("num_experts", "num_local_experts"),
            "qwen3_moe": ("num_experts", "num_local_experts"), "olmoe": ("num_experts", "num_local_experts"),
            "deepseek_v3": ("n_routed_experts", "num_local_experts"), "gpt_oss": ("num_local_experts", "num_experts")}
_HIDDEN = {"mixtral": "intermediate_size", "qwen2_moe": "moe_intermediate_size", "qwen3_moe": "moe_intermediate_size",
           "olmoe": "intermediate_size", "deepseek_v3": "moe_intermediate_size", "gpt_oss": "intermediate_size"}
_QWEN = ("router_aux_loss_coef", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size")
_EXTRA = {"mixtral": ("router_aux_loss_coef", "router_jitter_noise"), "qwen3_moe": _QWEN,
          "qwen2_moe": (*_QWEN, "shared_expert_intermediate_size"), "olmoe": ("router_aux_loss_coef", "norm_topk_prob"),
          "deepseek_v3": ("norm_topk_prob", "first_k_dense_replace", "intermediate_size", "n_shared_experts",
                          "routed_scaling_factor", "n_group", "topk_group", "topk_method", "scoring_func",
                          "moe_layer_freq"),
          "gpt_oss": ("router_aux_loss_coef", "swiglu_alpha", "swiglu_limit")}
MOE_KEYS: dict[str, frozenset[str]] = {f: frozenset({*_EXPERTS[f], _HIDDEN[f], "num_experts_per_tok", "hidden_act",
                                                     *_EXTRA[f]}) for f in FAMILIES}
# MoE fields of config.json that describe training or transformers' own runtime, not the model,
# and why moe_fields_from_hf leaves them to the run
MOE_IGNORED: dict[str, str] = {
    "output_router_logits": "whether transformers returns router logits and adds its balance loss; moeflow's MoE "
                            "always reports its losses, weighted by load_balance_coef",
    "aux_loss_alpha": "DeepSeek's sequence-wise balance loss (transformers computes none): set load_balance_coef",
    "seq_aux": "DeepSeek's sequence-wise balance loss (transformers computes none)",
    "ep_size": "DeepSeek's own expert-parallel size; moeflow's expert parallelism is chosen per run",
}
DEEPSEEK_BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (its report's gamma)
_ABSENT = object()


def _refuse(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"config.json: {name}={value!r:.80} is not supported: {why}")


_KINDS = {"count": "an int >= 1", "index": "an int >= 0", "number": "a finite number >= 0", "bool": "a bool",
          "str": "a string"}


def _ok(value: object, kind: str) -> bool:
    integer = isinstance(value, int) and not isinstance(value, bool)
    if kind in ("count", "index"):
        return integer and value >= (1 if kind == "count" else 0)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return isinstance(value, bool if kind == "bool" else str)


def _value(hf: Mapping, name: str, kind: str, default: object = _ABSENT) -> object:
    """``hf[name]`` checked to be ``kind`` (``_KINDS``); absent or null gives ``default`` (none:
    refused as missing)."""
    value = hf.get(name)
    if value is None:
        if default is _ABSENT:
            raise ValueError(f"config.json: required field {name!r} is missing")
        return default
    if not _ok(value, kind):
        raise ValueError(f"config.json: {name}={value!r:.80} ({type(value).__name__}), expected {_KINDS[kind]}")
    return value


def _aliased(hf: Mapping, names: tuple[str, ...]) -> int:
    """The expert count under any of its names (transformers' ``attribute_map`` aliases)."""
    given = {n: _value(hf, n, "count") for n in names if hf.get(n) is not None}
    if not given:
        raise ValueError(f"config.json: required field {names[0]!r} is missing")
    if len(set(given.values())) > 1:
        raise ValueError(f"config.json: {' and '.join(f'{n}={v}' for n, v in given.items())} disagree")
    return next(iter(given.values()))


def _check(hf: Mapping, name: str, want: object, why: str) -> None:
    """Refuse ``hf[name]`` unless absent, null or ``want`` (what moeflow's map computes)."""
    got = hf.get(name)
    if got is not None and (got != want or isinstance(got, bool) != isinstance(want, bool)):
        raise _refuse(name, got, why)


def moe_fields_from_hf(hf: Mapping) -> dict[str, object]:
    """The FFN fields (``FFN_FIELDS``) of the ``GPTConfig`` equivalent to the config.json dict
    ``hf`` of a family in ``FAMILIES`` (by its ``model_type``); dropless (``capacity_factor=0``)
    as transformers' blocks are."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise _refuse("model_type", family, f"the MoE families are {list(FAMILIES)}")
    E = _aliased(hf, _EXPERTS[family])
    out: dict[str, object] = {
        "num_experts": E, "top_k": _value(hf, "num_experts_per_tok", "count"), "expert_hidden": _value(
            hf, _HIDDEN[family], "count"), "capacity_factor": 0.0, "num_shared_experts": 0, "shared_hidden": None,
        "shared_gate": False, "moe_every": 1, "dense_layers": (), "dense_hidden": None}
    coef = float(_value(hf, "router_aux_loss_coef", "number", 0.01 if family == "olmoe" else 0.001))
    if family != "gpt_oss":  # (gpt-oss's experts ignore hidden_act: their gate is swiglu_oai)
        _check(hf, "hidden_act", "silu", "the experts' gate is SiLU (SwiGLU) in moeflow's map")
    experts = ExpertsConfig(activation="swiglu")
    if family == "mixtral":
        _check(hf, "router_jitter_noise", 0.0, "transformers jitters the experts' input too, moeflow's "
               "jitter_eps the router's only")
        router = RouterConfig(scoring="topk_softmax", load_balance_coef=coef)
    elif family == "gpt_oss":
        for name, want in (("swiglu_alpha", SWIGLU_OAI_ALPHA), ("swiglu_limit", SWIGLU_OAI_LIMIT)):
            _check(hf, name, want, f"moeflow's swiglu_oai has gpt-oss's published {name}={want}")
        router = RouterConfig(scoring="topk_softmax", bias=True, load_balance_coef=coef)
        experts = ExpertsConfig(activation="swiglu_oai", bias=True)
    elif family == "deepseek_v3":
        _check(hf, "topk_method", "noaux_tc", "moeflow maps DeepSeek-V3's group-limited 'noaux_tc'")
        _check(hf, "scoring_func", "sigmoid", "DeepSeek-V3 scores with a sigmoid")
        _check(hf, "moe_layer_freq", 1, "transformers makes every block past first_k_dense_replace MoE")
        groups, top_groups = _value(hf, "n_group", "count", 1), _value(hf, "topk_group", "count", 1)
        if E % groups or top_groups > groups:
            raise _refuse("n_group", groups, f"{E} experts in {groups} groups, topk_group={top_groups}")
        router = RouterConfig(scoring="sigmoid", normalize_topk=_value(hf, "norm_topk_prob", "bool", True),
                              routed_scaling_factor=float(_value(hf, "routed_scaling_factor", "number", 1.0)),
                              num_groups=groups, topk_groups=top_groups, group_score="top2_sum",
                              load_balance_coef=0.0, bias_update_rate=DEEPSEEK_BIAS_RATE, dtype=torch.float32)
        shared = _value(hf, "n_shared_experts", "index", 0)
        first_dense = _value(hf, "first_k_dense_replace", "index", 0)
        out.update(num_shared_experts=shared, shared_hidden=shared * out["expert_hidden"] if shared else None,
                   dense_layers=tuple(range(first_dense)),
                   dense_hidden=_value(hf, "intermediate_size", "count") if first_dense else None)
    else:  # the Qwen families and OLMoE: softmax over all experts, top-k, renormalised or not
        router = RouterConfig(scoring="softmax", normalize_topk=_value(hf, "norm_topk_prob", "bool", False),
                              load_balance_coef=coef)
        if family != "olmoe":
            dense = hf.get("mlp_only_layers") or []
            if not isinstance(dense, list) or not all(_ok(i, "index") for i in dense):
                raise _refuse("mlp_only_layers", dense, "expected a list of block indices (ints >= 0)")
            step = _value(hf, "decoder_sparse_step", "count", 1)
            if dense or step > 1:
                out.update(dense_hidden=_value(hf, "intermediate_size", "count"))
            out.update(moe_every=step, dense_layers=tuple(sorted(set(dense))))
        if family == "qwen2_moe":
            out.update(num_shared_experts=1, shared_gate=True,
                       shared_hidden=_value(hf, "shared_expert_intermediate_size", "count"))
    out.update(router=router, experts=experts)
    return out


def moe_fields_to_hf(family: str, cfg: GPTConfig) -> dict[str, object]:
    """The config.json FFN fields of ``family`` for ``cfg`` (``moe_fields_from_hf``'s inverse);
    ``ValueError`` naming the first field the family cannot express. Left out: how the router
    trains (noise, jitter, dropout, losses but ``load_balance_coef``, the bias update's rate)
    and how the experts run (backend, recompute), which are no part of the family's config."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    r = cfg.router
    hf: dict[str, object] = {"model_type": family, _EXPERTS[family][0]: cfg.num_experts,
                             "num_experts_per_tok": cfg.top_k, _HIDDEN[family]: cfg.expert_hidden, "hidden_act": "silu"}
    if family != "deepseek_v3":
        hf["router_aux_loss_coef"] = r.load_balance_coef
    if family in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"):
        hf["norm_topk_prob"] = r.normalize_topk or r.scoring == "topk_softmax"
    if family in ("qwen2_moe", "qwen3_moe"):
        hf.update(decoder_sparse_step=cfg.moe_every or 1, mlp_only_layers=list(cfg.dense_layers),
                  intermediate_size=cfg.dense_hidden or cfg.expert_hidden)
    if family == "qwen2_moe":
        hf["shared_expert_intermediate_size"] = cfg.shared_hidden or cfg.num_shared_experts * cfg.expert_hidden
    if family == "deepseek_v3":
        hf.update(n_shared_experts=cfg.num_shared_experts, first_k_dense_replace=len(cfg.dense_layers),
                  intermediate_size=cfg.dense_hidden or cfg.expert_hidden, n_group=r.num_groups,
                  routed_scaling_factor=r.routed_scaling_factor, topk_group=r.topk_groups, topk_method="noaux_tc",
                  scoring_func="sigmoid")
    if family == "gpt_oss":
        hf.update(swiglu_alpha=SWIGLU_OAI_ALPHA, swiglu_limit=SWIGLU_OAI_LIMIT)
    ours, back = _model_view(cfg, {n: getattr(cfg, n) for n in FFN_FIELDS}), _model_view(cfg, moe_fields_from_hf(hf))
    for name, value in ours.items():
        if value != back[name]:
            raise ValueError(f"cannot export to {family}: {name}={value!r} (the family has {back[name]!r})")
    return hf


def _model_view(cfg: GPTConfig, fields: Mapping) -> dict[str, object]:
    """What FFN ``fields`` (of a config shaped like ``cfg``) say about the model's outputs: the
    router's routing (top-k of a softmax renormalised = softmax over the top-k logits), the
    experts' activation and biases, the shared FFN's width (one fused FFN however many shared
    experts make it up) and gate, and the dense blocks' width where there is a dense block."""
    r = fields["router"]
    scoring, norm = ("topk_softmax", False) if (r.scoring, r.normalize_topk) == ("softmax", True) else \
        (r.scoring, r.normalize_topk)
    n_shared, H = fields["num_shared_experts"], fields["expert_hidden"]
    dense = any(i in fields["dense_layers"] or not fields["moe_every"] or (i + 1) % fields["moe_every"]
                for i in range(cfg.n_layers))
    view = {name: fields[name] for name in ("num_experts", "top_k", "expert_hidden", "capacity_factor", "moe_every")}
    view["dense_layers"] = tuple(sorted(set(fields["dense_layers"])))
    view.update({
        "router": (r.kind, scoring, norm, r.routed_scaling_factor, r.num_groups, r.topk_groups,
                   r.group_score if r.num_groups > 1 else None, r.bias, r.bias_update_rate > 0),
        "experts": (fields["experts"].activation, fields["experts"].bias),
        "shared width": (fields["shared_hidden"] or n_shared * H) if n_shared else 0,
        "shared_gate": fields["shared_gate"] and n_shared > 0,
        "dense_hidden": (fields["dense_hidden"] or H) if dense else None,
    })
    return view


# ------------------------------------------------------------------------------------- tensors

_PROJ = ("gate_proj", "up_proj", "down_proj")
# family -> (its MoE block's module in the files, the router's, the per-expert (gate, up, down)
# linears (None: gpt-oss's fused tensors), the shared experts' module, their gate's)
_LAYOUT: dict[str, tuple[str, str, tuple[str, str, str] | None, str | None, str | None]] = {
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2"), None, None),
    "qwen2_moe": ("mlp", "gate", _PROJ, "shared_expert", "shared_expert_gate"),
    "qwen3_moe": ("mlp", "gate", _PROJ, None, None),
    "olmoe": ("mlp", "gate", _PROJ, None, None),
    "deepseek_v3": ("mlp", "gate", _PROJ, "shared_experts", None),
    "gpt_oss": ("mlp", "router", None, None, None),
}


def hf_ffn_shapes(family: str, cfg: GPTConfig, layer: int, *, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors of block ``layer``'s FFN (names relative to the decoder layer,
    ``model.layers.{layer}.``) and their shapes: the files' layout, or with ``fused``
    transformers' in-memory one (``mlp.experts.gate_up_proj [E, 2H, D]``; gpt-oss has one)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    block, router, linears, shared, shared_gate = _LAYOUT[family]
    D, E, H = cfg.dim, cfg.num_experts, cfg.expert_hidden
    if not cfg.is_moe_layer(layer):
        if family not in ("qwen2_moe", "qwen3_moe", "deepseek_v3"):
            raise ValueError(f"{family} has no dense FFN blocks, but block {layer} of this GPTConfig is dense")
        Hd = cfg.dense_hidden or H
        return {f"mlp.{name}.weight": shape for name, shape in zip(_PROJ, ((Hd, D), (Hd, D), (D, Hd)))}
    block = "mlp" if fused or linears is None else block
    out = {f"{block}.{router}.weight": (E, D)}
    if linears is None:  # gpt-oss: [E, D, 2H] (gate, up interleaved), biases
        out.update({"mlp.router.bias": (E,), "mlp.experts.gate_up_proj": (E, D, 2 * H),
                    "mlp.experts.gate_up_proj_bias": (E, 2 * H), "mlp.experts.down_proj": (E, H, D),
                    "mlp.experts.down_proj_bias": (E, D)})
    elif fused:
        out.update({"mlp.experts.gate_up_proj": (E, 2 * H, D), "mlp.experts.down_proj": (E, D, H)})
    else:
        for e in range(E):
            out.update({f"{block}.experts.{e}.{name}.weight": shape
                        for name, shape in zip(linears, ((H, D), (H, D), (D, H)))})
    if family == "deepseek_v3":
        out["mlp.gate.e_score_correction_bias"] = (E,)
    if shared is not None and cfg.num_shared_experts:
        Hs = cfg.shared_hidden or cfg.num_shared_experts * H
        out.update({f"mlp.{shared}.{name}.weight": shape for name, shape in zip(_PROJ, ((Hs, D), (Hs, D), (D, Hs)))})
    if shared_gate is not None and cfg.shared_gate:
        out[f"mlp.{shared_gate}.weight"] = (1, D)
    return out


def ffn_from_hf(family: str, tensors: Mapping[str, torch.Tensor], cfg: GPTConfig, layer: int, *,
                hf_prefix: str | None = None, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """moeflow's tensors of block ``layer``'s FFN (``prefix``, default ``layers.{layer}.``, then
    ``ffn.``...) from the Hugging Face ones in ``tensors`` (any mapping, e.g. a lazy view of the
    files: exactly ``hf_ffn_shapes``' names under ``hf_prefix``, default ``model.layers.{layer}.``,
    are read, each checked for its shape; the fused layout where ``mlp.experts.gate_up_proj`` is
    there). De-interleaves gpt-oss's gate and up columns."""
    hp = f"model.layers.{layer}." if hf_prefix is None else hf_prefix
    ours = f"layers.{layer}.ffn." if prefix is None else f"{prefix}ffn."
    fused = family != "gpt_oss" and f"{hp}mlp.experts.gate_up_proj" in tensors
    shapes = hf_ffn_shapes(family, cfg, layer, fused=fused)
    block, router, linears, shared, shared_gate = _LAYOUT[family]

    def get(name: str) -> torch.Tensor:
        if hp + name not in tensors:
            raise ValueError(f"the Hugging Face checkpoint has no tensor {hp + name!r}")
        t = tensors[hp + name]
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"tensor {hp + name!r} has shape {tuple(t.shape)}, the config gives {shapes[name]}")
        return t

    if not cfg.is_moe_layer(layer):
        gate, up, down = (get(f"mlp.{name}.weight") for name in _PROJ)
        return {f"{ours}proj_in.weight": torch.cat([gate, up]), f"{ours}proj_out.weight": down.contiguous()}
    block = "mlp" if fused or linears is None else block
    out = {f"{ours}router.linear.weight": get(f"{block}.{router}.weight").contiguous()}
    if linears is None:
        w, b = get("mlp.experts.gate_up_proj"), get("mlp.experts.gate_up_proj_bias")
        out.update({f"{ours}router.linear.bias": get("mlp.router.bias").contiguous(),
                    f"{ours}experts.w_in": torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1),
                    f"{ours}experts.b_in": torch.cat([b[..., 0::2], b[..., 1::2]], dim=-1),
                    f"{ours}experts.w_out": get("mlp.experts.down_proj").contiguous(),
                    f"{ours}experts.b_out": get("mlp.experts.down_proj_bias").contiguous()})
    elif fused:
        out[f"{ours}experts.w_in"] = get("mlp.experts.gate_up_proj").transpose(1, 2).contiguous()
        out[f"{ours}experts.w_out"] = get("mlp.experts.down_proj").transpose(1, 2).contiguous()
    else:
        (g, u, d), E = linears, cfg.num_experts
        out[f"{ours}experts.w_in"] = torch.stack([torch.cat([get(f"{block}.experts.{e}.{g}.weight"),
                                                             get(f"{block}.experts.{e}.{u}.weight")]).T
                                                  for e in range(E)]).contiguous()
        out[f"{ours}experts.w_out"] = torch.stack([get(f"{block}.experts.{e}.{d}.weight").T
                                                   for e in range(E)]).contiguous()
    if family == "deepseek_v3":
        out[f"{ours}router.expert_bias"] = get("mlp.gate.e_score_correction_bias").contiguous()
    if shared is not None and cfg.num_shared_experts:
        gate, up, down = (get(f"mlp.{shared}.{name}.weight") for name in _PROJ)
        out[f"{ours}shared.proj_in.weight"] = torch.cat([gate, up])
        out[f"{ours}shared.proj_out.weight"] = down.contiguous()
    if shared_gate is not None and cfg.shared_gate:
        out[f"{ours}shared.gate.weight"] = get(f"mlp.{shared_gate}.weight").contiguous()
    return out


def ffn_to_hf(family: str, state: Mapping[str, torch.Tensor], cfg: GPTConfig, layer: int, *,
              hf_prefix: str | None = None, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """``ffn_from_hf``'s inverse: block ``layer``'s FFN tensors of ``state`` (moeflow's names
    under ``prefix``) in the family's file layout (``hf_ffn_shapes`` with ``fused=False``), under
    ``hf_prefix``; gpt-oss's gate and up columns interleaved again."""
    hp = f"model.layers.{layer}." if hf_prefix is None else hf_prefix
    ours = f"layers.{layer}.ffn." if prefix is None else f"{prefix}ffn."
    block, router, linears, shared, shared_gate = _LAYOUT[family]
    H = cfg.expert_hidden
    hf_ffn_shapes(family, cfg, layer)  # (refuses a dense block where the family has none)
    out: dict[str, torch.Tensor] = {}

    def split(w_in: torch.Tensor, out_w: torch.Tensor, where: str) -> None:  # a DenseFFN's [2H, D] in and [D, H] out
        h = w_in.shape[0] // 2
        out.update({f"{where}gate_proj.weight": w_in[:h].contiguous(), f"{where}up_proj.weight": w_in[h:].contiguous(),
                    f"{where}down_proj.weight": out_w.contiguous()})

    if not cfg.is_moe_layer(layer):
        split(state[f"{ours}proj_in.weight"], state[f"{ours}proj_out.weight"], "mlp.")
    else:
        block = "mlp" if linears is None else block
        out[f"{block}.{router}.weight"] = state[f"{ours}router.linear.weight"].contiguous()
        w_in, w_out = state[f"{ours}experts.w_in"], state[f"{ours}experts.w_out"]
        if linears is None:
            b_in = state[f"{ours}experts.b_in"]
            out.update({"mlp.router.bias": state[f"{ours}router.linear.bias"].contiguous(),
                        "mlp.experts.gate_up_proj": torch.stack([w_in[..., :H], w_in[..., H:]], -1).flatten(-2),
                        "mlp.experts.gate_up_proj_bias": torch.stack([b_in[..., :H], b_in[..., H:]], -1).flatten(-2),
                        "mlp.experts.down_proj": w_out.contiguous(),
                        "mlp.experts.down_proj_bias": state[f"{ours}experts.b_out"].contiguous()})
        else:
            g, u, d = linears
            for e in range(cfg.num_experts):
                out.update({f"{block}.experts.{e}.{g}.weight": w_in[e, :, :H].T.contiguous(),
                            f"{block}.experts.{e}.{u}.weight": w_in[e, :, H:].T.contiguous(),
                            f"{block}.experts.{e}.{d}.weight": w_out[e].T.contiguous()})
        if family == "deepseek_v3":
            out["mlp.gate.e_score_correction_bias"] = state[f"{ours}router.expert_bias"].contiguous()
        if shared is not None and cfg.num_shared_experts:
            split(state[f"{ours}shared.proj_in.weight"], state[f"{ours}shared.proj_out.weight"], f"mlp.{shared}.")
        if shared_gate is not None and cfg.shared_gate:
            out[f"mlp.{shared_gate}.weight"] = state[f"{ours}shared.gate.weight"].contiguous()
    return {hp + name: t for name, t in out.items()}
