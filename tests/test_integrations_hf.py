"""Hugging Face transformers drop-in (moeflow.integrations.hf) against eager transformers.

Every family is built offline from a tiny random config (no hub access); all parameters (and
DeepSeek-style selection biases) are redrawn so nothing runs on ``torch.empty`` garbage or zeros.
Both entry points are compared with ``experts_implementation="eager"``: logits, router logits,
the HF aux loss, and in training mode the gradients of every parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (moeflow's 'hf' extra): the HF drop-in is not tested"
)
from moeflow.integrations import hf  # noqa: E402

from helpers import rel_err  # noqa: E402

pytestmark = pytest.mark.integration

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
_DEEPSEEK_LIKE = dict(
    intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
    num_hidden_layers=3, norm_topk_prob=True, routed_scaling_factor=2.5,
)
# family -> (config class, model class, config fields); every family has 2 MoE layers
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8,
             num_experts_per_tok=3, norm_topk_prob=False),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(intermediate_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=8),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(_DEEPSEEK_LIKE, num_key_value_heads=4, num_experts_per_tok=3, n_group=4, topk_group=2, q_lora_rank=16,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    ),
    "gpt_oss": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, head_dim=8, sliding_window=8),
    ),
    "qwen3_next": (
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        dict(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=8,
             num_experts_per_tok=2, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2,
             linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2),
    ),
    "glm4_moe": (
        "Glm4MoeConfig", "Glm4MoeForCausalLM", dict(_DEEPSEEK_LIKE, num_experts_per_tok=2, n_group=2, topk_group=1, head_dim=8),
    ),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(_DEEPSEEK_LIKE, num_experts_per_tok=2, n_group=2, topk_group=1, head_dim=8)),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
        dict(intermediate_size=64, moe_intermediate_size=24, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
             moe_layer_start_index=0),
    ),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2, head_dim=8)),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2)),
}
FAMILIES = sorted(FAMILY_CONFIGS)


def build(family: str, gen: torch.Generator, dtype: torch.dtype = torch.float32, **overrides: object) -> torch.nn.Module:
    """The family's tiny CausalLM with every parameter redrawn from N(0, 0.2^2)."""
    config_cls, model_cls, fields = FAMILY_CONFIGS[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **fields, **overrides}, experts_implementation="eager")
    model = getattr(transformers, model_cls)(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-style selection bias: not zero
                b.copy_(torch.randn(b.shape, generator=gen, dtype=torch.float64) * 0.1)
    return model


def run(model: torch.nn.Module, ids: torch.Tensor, probe: torch.Tensor) -> tuple[object, dict[str, torch.Tensor]]:
    """Forward with router logits, backward of a random projection of the logits (+ aux loss)."""
    model.zero_grad(set_to_none=True)
    out = model(ids, output_router_logits=True)
    loss = (out.logits * probe).sum()
    if out.aux_loss is not None:
        loss = loss + out.aux_loss
    loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same(out, grads, ref, ref_grads, tol: float) -> float:
    worst = rel_err(out.logits, ref.logits)
    assert worst <= tol, f"logits rel err {worst:.3g}"
    assert len(out.router_logits) == len(ref.router_logits) == 2
    for a, b in zip(out.router_logits, ref.router_logits):
        assert rel_err(a, b) <= tol
    if ref.aux_loss is not None:
        assert rel_err(out.aux_loss, ref.aux_loss) <= tol
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        if ref_grads[name].abs().max() == 0:  # e.g. an expert no token chose in this batch
            assert g.abs().max() == 0, name
            continue
        e = rel_err(g, ref_grads[name])
        assert e <= tol, f"grad {name}: rel err {e:.3g}"
        worst = max(worst, e)
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("entry", ["experts_implementation", "patch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_eager(family: str, entry: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    ref_model = build(family, gen, dtype).train()
    model = copy.deepcopy(ref_model)
    if entry == "patch":
        names = hf.patch(model)
        assert len(names) == 2 and all(hf.is_patched(model.get_submodule(n)) for n in names)
        # the same parameters, same names: the state dict is untouched
        assert list(model.state_dict()) == list(ref_model.state_dict())
    else:
        model.set_experts_implementation("moeflow")
        assert model.config._experts_implementation == "moeflow"
    ids = torch.randint(3, VOCAB, (2, 12), generator=gen)
    ref, ref_grads = run(ref_model, ids, probe := torch.randn(2, 12, VOCAB, generator=gen, dtype=dtype))
    out, grads = run(model, ids, probe)
    assert len(grads) > 0 and any("experts" in n for n in grads)
    assert_same(out, grads, ref, ref_grads, tol=1e-5 if dtype == torch.float32 else 1e-12)


def test_patch_keeps_parameter_storage_and_state_dict_roundtrip(gen: torch.Generator) -> None:
    model = build("qwen2_moe", gen)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hf.patch(model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # no copies
    fresh = build("qwen2_moe", torch.Generator().manual_seed(1))
    hf.patch(fresh)
    fresh.load_state_dict(before)  # strict: same keys
    ids = torch.randint(3, VOCAB, (1, 9), generator=gen)
    torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)
    # patching twice is a no-op that reports the same blocks
    assert hf.patch(model) == hf.patch(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_interface_registered_and_selectable_at_construction(gen: torch.Generator) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert hf.EXPERTS_IMPLEMENTATION in ALL_EXPERTS_FUNCTIONS
    config_cls, model_cls, fields = FAMILY_CONFIGS["mixtral"]
    config = getattr(transformers, config_cls)(**{**COMMON, **fields}, experts_implementation="moeflow")
    model = getattr(transformers, model_cls)(config)
    assert model.config._experts_implementation == "moeflow"


def test_experts_forward_empty_and_bad_shapes(gen: torch.Generator) -> None:
    model = build("mixtral", gen)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(0, 32, generator=gen)
    ids, w = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    y = hf.experts_forward(experts, x, ids, w)
    assert y.shape == (0, 32)
    x = torch.randn(5, 32, generator=gen)
    with pytest.raises(ValueError, match="ids_TK"):
        hf.experts_forward(experts, x, torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2))
    with pytest.raises(ValueError, match="hidden_TD"):
        hf.experts_forward(experts, x[None], torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2))
    with pytest.raises(TypeError, match="dtype"):
        hf.experts_forward(experts, x.double(), torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2))
    with pytest.raises(TypeError, match="integer expert ids"):
        hf.experts_forward(experts, x, torch.zeros(5, 2), torch.rand(5, 2))
    with pytest.raises(TypeError, match="use_experts_implementation"):
        hf.experts_forward(torch.nn.Linear(32, 32), x, torch.zeros(5, 2, dtype=torch.long), torch.rand(5, 2))


def test_expert_parallel_experts_are_rejected(gen: torch.Generator) -> None:
    model = build("mixtral", gen)
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    with pytest.raises(ValueError, match="expert-parallel"):
        hf.patch(model)


def test_patch_rejects_bad_inputs(gen: torch.Generator) -> None:
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, intermediate_size=48)
    )
    with pytest.raises(ValueError, match="model_type='llama'"):
        hf.patch(dense)
    with pytest.raises(ValueError, match="contains no MixtralSparseMoeBlock"):
        hf.patch(dense, family="mixtral")
    with pytest.raises(ValueError, match="family must be one of"):
        hf.patch(build("mixtral", gen), family="switch_transformers_xl")
    with pytest.raises(ValueError, match="contains no DeepseekV3MoE"):
        hf.patch(build("mixtral", gen), family="deepseek_v3")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        hf.patch("mixtral")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass family="):
        hf.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_patched_block_jitter_and_tuple_output_match_eager(gen: torch.Generator) -> None:
    """Mixtral's training-time input jitter draws the same random numbers; GPT-OSS's block
    returns ``(y, router weights)`` like HF."""
    ref_model = build("mixtral", gen, router_jitter_noise=0.1).train()
    model = copy.deepcopy(ref_model)
    hf.patch(model)
    ids = torch.randint(3, VOCAB, (2, 12), generator=gen)
    probe = torch.randn(2, 12, VOCAB, generator=gen)
    torch.manual_seed(123)
    ref, ref_grads = run(ref_model, ids, probe)
    torch.manual_seed(123)
    out, grads = run(model, ids, probe)
    assert_same(out, grads, ref, ref_grads, tol=1e-5)

    oss = build("gpt_oss", gen)
    block = oss.model.layers[0].mlp
    x = torch.randn(2, 5, 32, generator=gen)
    y_ref, w_ref = block(x)
    hf.patch(oss)
    y, w = oss.model.layers[0].mlp(x)
    assert rel_err(y, y_ref) <= 1e-5 and torch.equal(w, w_ref)


def test_grouped_mm_on_transposed_weight_views_matches_loop(gen: torch.Generator) -> None:
    """HF stores ``[E, F, D]``; moeflow reads it as the ``[E, D, F]`` transpose. The native
    grouped matmul (and its weight gradient, produced in the parameter's layout) must agree
    with the per-expert loop."""
    from moeflow.kernels.grouped_mm import grouped_mm_loop, grouped_mm_native, native_grouped_mm_supported

    if not native_grouped_mm_supported(torch.device("cpu"), torch.float32, (16, 24)):
        pytest.skip("F.grouped_mm is not available for fp32 on this CPU build")
    counts = torch.tensor([3, 0, 7, 5])
    offs = torch.cumsum(counts, 0)
    x = torch.randn(int(counts.sum()), 16, generator=gen, requires_grad=True)
    w_EFD = torch.randn(4, 24, 16, generator=gen, requires_grad=True)
    dy = torch.randn(int(counts.sum()), 24, generator=gen)
    grads = []
    for fn in (grouped_mm_native, grouped_mm_loop):
        y = fn(x, w_EFD.transpose(-2, -1), offs)
        gx, gw = torch.autograd.grad(y, (x, w_EFD), dy)
        grads.append((y, gx, gw))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
