"""The DeepSeek-V3 family (``moeflow.convert.deepseek_v3``) against transformers, offline: a tiny
random ``DeepseekV3ForCausalLM`` with every field exercised (query bottleneck, YaRN with
mscale, pair rotation, a first dense block, group-limited routing with the correction bias,
routed scaling, two shared experts), saved sharded by ``save_pretrained`` and read by
``gpt_from_hf``: logits on a left-padded batch (fp64 1e-10 under ``KeepFp64`` with our fp64
rotary frequencies in transformers' model, fp32 1e-5 as it is), the gradients of a loss, greedy
tokens against transformers' ``generate`` (eager and compiled), the round trip through
``gpt_to_hf`` and transformers, a 2-rank expert-parallel fine-tune step against one process, a
block-wise FP8 checkpoint made here, and the refusals of fields moeflow cannot express.

transformers is imported inside the tests: the expert-parallel ranks import this module.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moeflow
from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.deepseek_v3 import DEEPSEEK_V3, gpt_config_from_hf, hf_config_from_gpt
from moeflow.convert.hf import gpt_from_hf, gpt_to_hf
from moeflow.convert.hf_model import state_dict_from_tensors
from moeflow.models.generation import generate
from moeflow.models.gpt import MoEGPT
from moeflow.models.gpt_config import AttentionConfig, GPTConfig
from moeflow.models.rope import rope_frequencies, softmax_scale

from helpers import KeepFp64, rel_err, spawn_ranks

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.7}
# every field of the issue: q_lora_rank, YaRN with mscale, rope_interleave, one dense block,
# n_group/topk_group, routed scaling, two shared experts; rms_norm_eps != the latent norms' 1e-6.
# No pad token (as DeepSeek-V3's own config): transformers' embedding would keep its row out of
# training (padding_idx), moeflow's trains every row
FIELDS = dict(vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
              num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
              norm_topk_prob=True, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6,
              v_head_dim=10, rope_interleave=True, max_position_embeddings=64, rms_norm_eps=1e-5,
              rope_parameters=YARN, bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 8], [6, 6, 11, 30, 2]]


def _hf_model(**fields: object):  # type: ignore[no-untyped-def]
    """A random ``DeepseekV3ForCausalLM`` (fp32, eager attention and experts): weights ``N(0, 0.3)`` (greedy
    picks far from ties), norms around one, the correction bias drawn too."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(**{**FIELDS, **fields})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # (its grouped_mm takes no fp64)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "rotary" not in name:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64) * 0.3 + (1.0 if "norm" in name else 0.0))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``(directory, transformers' model)``: the model saved in shards of at most 40 KB."""
    model = _hf_model()
    path = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(path, max_shard_size="40KB")
    return path, model


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, PROMPTS))
    return (torch.tensor([[0] * (P - len(r)) + r for r in PROMPTS]),
            torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in PROMPTS]))


def _in(dtype: torch.dtype, hf):  # type: ignore[no-untyped-def]
    """transformers' model in ``dtype``; in fp64 with our fp64 rotary frequencies (its own are
    computed in fp32: the tables would differ by fp32's rounding, not the formulas)."""
    hf = copy.deepcopy(hf).to(dtype)
    if dtype == torch.float64:
        rotary = hf.model.rotary_emb
        inv, factor = rope_frequencies(6, 500.0, gpt_config_from_hf(hf.config.to_dict()).rope_scaling,
                                       dtype=torch.float64)
        assert factor == pytest.approx(rotary.attention_scaling, rel=1e-15)
        torch.testing.assert_close(inv.float(), rotary.inv_freq.float(), rtol=1e-6, atol=0)
        rotary.inv_freq = inv
    return hf


# ------------------------------------------------------------------------------------------
# the checkpoint as transformers writes it


@pytest.mark.integration
def test_the_directory_is_sharded_and_its_config_maps_every_field(saved):
    """``save_pretrained`` wrote shards; the config maps onto latent attention, YaRN with both
    mscales, DeepSeek's routing, a dense first block and two shared experts."""
    path, hf = saved
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("model-*.safetensors"))) > 2
    cfg = gpt_config_from_hf(json.loads((path / "config.json").read_text()))
    a, r = cfg.attention, cfg.router
    assert (a.kind, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
            a.rope_interleaved) == ("mla", 12, 16, 8, 6, 10, True)
    assert cfg.rope_scaling.mscale == 0.9 and cfg.rope_scaling.mscale_all_dim == 0.7 and cfg.norm_eps == 1e-5
    assert (r.scoring, r.num_groups, r.topk_groups, r.routed_scaling_factor, r.normalize_topk) == \
        ("sigmoid", 4, 2, 2.5, True)
    assert cfg.dense_layers == (0,) and cfg.dense_hidden == 40 and cfg.shared_hidden == 24
    assert softmax_scale(14, cfg.rope_scaling) == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-15)


@pytest.mark.integration
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_logits_equal_transformers_on_a_left_padded_batch(saved, dtype):
    """transformers on the left-padded batch (its attention mask, positions counted from each
    row's first token) against ours on each row alone (every real column's logits) and against
    our cached prefill of the same padded batch (the last column's)."""
    path, hf = saved
    hf = _in(dtype, hf)
    ours = gpt_from_hf(path, dtype=dtype).eval()
    idx, mask = _left_padded()
    with torch.no_grad(), KeepFp64():
        ref = hf(idx, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    with torch.no_grad():
        for b, row in enumerate(PROMPTS):
            got = ours(torch.tensor([row]))[0]
            assert rel_err(got, ref[b, -len(row):]) <= TOL[dtype], b
        cache = ours.new_cache(idx.shape[1] - mask.sum(1), 16)
        assert rel_err(ours.forward_cached(idx, cache), ref[:, -1]) <= TOL[dtype]


@pytest.mark.integration
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_loss_gradients_equal_transformers(saved, dtype):
    """The next-token loss's gradient of every parameter equals transformers' (its gradients
    read through the family's tensor map: its in-memory fused experts), and the input loss."""
    path, hf = saved
    hf = _in(dtype, hf).train()
    ours = gpt_from_hf(path, dtype=dtype).train()
    idx = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(3))
    with KeepFp64():
        logits = hf(idx[:, :-1]).logits
        ref_loss = F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(dtype, torch.float32)),
                                   idx[:, 1:].flatten())
        ref_loss.backward()
    loss = ours.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert rel_err(loss, ref_loss) <= TOL[dtype]
    grads = {n: p.grad for n, p in hf.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers() if "rotary" not in n})
    want = state_dict_from_tensors(grads, DEEPSEEK_V3, ours.config)
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert rel_err(p.grad, want[name]) <= TOL[dtype], name


@pytest.mark.integration
def test_greedy_tokens_equal_transformers_generate_eager_and_compiled(saved):
    """32 greedy tokens per row of the left-padded batch: transformers' ``generate`` (its cache,
    fp32), ours eager and ``compile=True``."""
    path, hf = saved
    ours = gpt_from_hf(path).eval()
    idx, mask = _left_padded()
    with torch.no_grad():
        out = hf.generate(idx, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    want = out[:, idx.shape[1]:].tolist()
    assert len(want[0]) == 32 and len({tuple(r) for r in want}) == 3
    assert generate(ours, PROMPTS, 32, temperature=0).tokens == want
    assert generate(ours, PROMPTS, 32, temperature=0, compile=True).tokens == want


@pytest.mark.integration
def test_round_trip_through_transformers_changes_no_tensor(saved, tmp_path):
    """``gpt_to_hf`` -> ``DeepseekV3ForCausalLM.from_pretrained`` (no key missing or left over,
    the same logits) -> ``gpt_from_hf``: the same config and every tensor bit for bit."""
    transformers = pytest.importorskip("transformers")
    path, _ = saved
    ours = gpt_from_hf(path).eval()
    out = gpt_to_hf(ours, tmp_path / "out", family="deepseek_v3", max_shard_size="40KB")
    assert len(list(out.glob("model-*.safetensors"))) > 2
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    idx = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert rel_err(ours(idx), hf.eval()(idx).logits) <= 1e-5
    back = gpt_from_hf(out)
    assert back.config == ours.config
    state, got = ours.state_dict(), back.state_dict()
    assert state.keys() == got.keys()
    for name, t in state.items():
        if not name.endswith("router.load_counts"):  # (balancing statistics: start fresh)
            assert torch.equal(t, got[name]), name


# ------------------------------------------------------------------------------------------
# a 2-rank expert-parallel fine-tune step


def _fine_tune_step(rank: int, world: int, path: str) -> None:
    """One SGD step and one correction-bias update (as ``moeflow train`` does for DeepSeek's
    aux-loss-free balancing) on this rank's half of the batch, experts split over the ranks,
    against the single process on the whole batch (fp64): loss, every parameter, the biases."""
    from moeflow.parallel import all_reduce_gradients, dense_parameters, expert_parallel, sync_load_counts

    model = gpt_from_hf(path, dtype=torch.float64).train()
    idx = torch.randint(0, 61, (4, 11), generator=torch.Generator().manual_seed(7))
    x, y = idx[:, :-1], idx[:, 1:]
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    ref = copy.deepcopy(model)
    ref_loss = ref.loss(x, y)
    ref_loss.backward()
    ep = expert_parallel(copy.deepcopy(model))
    loss = ep.loss(x[rows], y[rows])
    (loss / world).backward()
    all_reduce_gradients(dense_parameters(ep), None, average=False)
    for m in (ref, ep):
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
    sync_load_counts(ep, None)
    moeflow.update_expert_bias(ref)
    moeflow.update_expert_bias(ep)
    e = ref.config.num_experts // world
    want = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        expected = want[name][rank * e:(rank + 1) * e] if getattr(p, "moeflow_expert", False) else want[name]
        # the router computes in fp32 (as transformers' DeepSeek-V3 does): its weight's gradient
        # sums fp32 terms, over the ranks' halves here and the whole batch there
        tol = 1e-7 if name.endswith("router.linear.weight") else 1e-10
        torch.testing.assert_close(p, expected, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    for name, b in ep.named_buffers():
        if name.endswith("router.expert_bias"):
            torch.testing.assert_close(b, dict(ref.named_buffers())[name], rtol=1e-12, atol=1e-12)
            assert b.abs().sum() > 0
    assert torch.isfinite(loss) and torch.isfinite(ref_loss)


CASES = {"fine_tune_step": _fine_tune_step}


@pytest.mark.distributed
def test_expert_parallel_fine_tune_step_equals_one_process(saved):
    pytest.importorskip("transformers")
    spawn_ranks(2, __name__, "fine_tune_step", str(saved[0]))


# ------------------------------------------------------------------------------------------
# a block-wise FP8 checkpoint


def _quantize(w_OI: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block-wise FP8, test side: per ``block x block`` block (edge blocks short)
    the scale ``amax / 448`` (e4m3's largest), the values ``w / scale`` in float8_e4m3fn."""
    O, I = w_OI.shape
    scale = torch.empty((O + block - 1) // block, (I + block - 1) // block)
    q = torch.empty(O, I, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w_OI[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            scale[i, j] = part.abs().max().clamp_min(1e-12) / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    w = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            w[rows, cols] = q[rows, cols].float() * scale[i, j]
    return w


@pytest.mark.integration
def test_a_block_fp8_checkpoint_dequantises_to_the_reference(saved, tmp_path):
    """Every linear weight of the attention, the dense and shared FFNs and the experts stored as
    FP8 with ``weight_scale_inv`` (5 x 5 blocks: the sizes leave short edge blocks), the config
    naming ``quant_method: fp8``: the model read equals, tensor for tensor, one read from the
    same directory holding the dequantised fp32 weights instead; quantisation did change the
    weights."""
    from safetensors.torch import load_file, save_file

    path, _ = saved
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    config = json.loads((path / "config.json").read_text())
    fp8, plain = dict(tensors), dict(tensors)
    quantised = [n for n, t in tensors.items() if t.dim() == 2 and ("self_attn." in n or "mlp." in n)
                 and not n.endswith("mlp.gate.weight")]
    assert any("experts.3.up_proj" in n for n in quantised) and any("kv_b_proj" in n for n in quantised)
    for name in quantised:
        q, scale = _quantize(tensors[name], 5)
        fp8[name], fp8[f"{name}_scale_inv"] = q, scale
        plain[name] = _dequantize(q, scale, 5)
    for where, state, qc in ((tmp_path / "fp8", fp8, {"quant_method": "fp8", "fmt": "e4m3",
                                                      "activation_scheme": "dynamic", "weight_block_size": [5, 5]}),
                             (tmp_path / "plain", plain, None)):
        where.mkdir()
        save_file(state, str(where / "model.safetensors"))
        (where / "config.json").write_text(json.dumps({**config, "quantization_config": qc} if qc else config))
    got, ref = gpt_from_hf(tmp_path / "fp8"), gpt_from_hf(tmp_path / "plain")
    assert got.embed.weight.dtype == torch.float32
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name
    original = gpt_from_hf(path)
    assert not torch.equal(got.layers[1].attn.kv_b_proj.weight, original.layers[1].attn.kv_b_proj.weight)
    assert rel_err(got.layers[1].ffn.experts.w_in, original.layers[1].ffn.experts.w_in) < 0.1


# ------------------------------------------------------------------------------------------
# what the config map refuses, and the defaults it takes

BASE = {"model_type": "deepseek_v3", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "moe_intermediate_size": 12, "intermediate_size": 40,
        "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 6, "v_head_dim": 10}


@pytest.mark.unit
@pytest.mark.parametrize("change,match", [
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(num_key_value_heads=None), "num_key_value_heads=128"),  # (absent: transformers' 128)
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial_rotary_factor=0.5"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(topk_method="greedy"), "topk_method='greedy'"),
    (dict(n_group=3), "n_group=3"),
    (dict(q_lora_rank=0), "q_lora_rank=0"),
    (dict(rope_interleave="yes"), "rope_interleave='yes'"),
    (dict(kv_lora_rank=-1), "kv_lora_rank=-1"),
    (dict(sliding_window=8), "sliding_window=8"),
    (dict(model_type="deepseek_v2"), "model_type 'deepseek_v2'"),
])
def test_config_fields_moeflow_cannot_express_are_refused_by_name_and_value(change, match):
    hf = {k: v for k, v in {**BASE, **change}.items() if v is not None or k == "q_lora_rank"}
    with pytest.raises(CheckpointError, match=match.replace("(", r"\(").replace("[", r"\[")):
        gpt_config_from_hf(hf)


@pytest.mark.integration
def test_absent_fields_take_transformers_defaults_and_mscale_all_dim_alone_is_kept():
    """A config.json holding only the sizes maps like transformers' full config of it (every
    default, DeepSeek-V3's MoE shape included); ``mscale_all_dim`` without ``mscale`` still
    scales the softmax (transformers' ``yarn_apply_mscale``), and writing it back keeps it; the
    MTP and derived fields change nothing."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    sizes = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 128}
    full = transformers.DeepseekV3Config(**{k: v for k, v in sizes.items() if k != "model_type"}).to_dict()
    assert gpt_config_from_hf(sizes) == gpt_config_from_hf(full)
    cfg = gpt_config_from_hf(sizes)
    assert (cfg.num_experts, cfg.top_k, cfg.router.num_groups, cfg.dense_layers, cfg.attention.q_lora_rank) == \
        (256, 8, 8, (0, 1, 2), 1536)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "mscale_all_dim": 1.0}
    cfg = gpt_config_from_hf({**sizes, "rope_parameters": rope, "num_nextn_predict_layers": 1, "head_dim": 3})
    assert cfg.rope_scaling.mscale_all_dim == 1.0 and cfg.rope_scaling.mscale is None
    assert softmax_scale(192, cfg.rope_scaling) == pytest.approx(yarn_apply_mscale(rope, 192 ** -0.5), rel=1e-15)
    assert gpt_config_from_hf(hf_config_from_gpt(cfg)) == cfg


@pytest.mark.unit
@pytest.mark.parametrize("change,match", [
    (dict(attention=AttentionConfig()), "attention.kind='gqa'"),
    (dict(attention=AttentionConfig(kind="mla", o_bias=True)), "attention.o_bias=True"),
    (dict(dropout=0.1), "dropout=0.1"),
    (dict(experts=moeflow.ExpertsConfig(activation="gelu")), "experts"),
])
def test_export_refuses_what_deepseek_v3_cannot_hold(change, match):
    base = gpt_config_from_hf(BASE)
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    with pytest.raises(ValueError, match=f"cannot export to (DeepSeek-V3|deepseek_v3): {match}"):
        hf_config_from_gpt(GPTConfig(**{**fields, **change}))


@pytest.mark.unit
def test_an_exported_model_reads_back_to_its_config():
    """``hf_config_from_gpt`` -> ``gpt_config_from_hf`` is the identity (a query projection, no
    rope scaling, tied embeddings), and the tensor map names every parameter once."""
    cfg = gpt_config_from_hf({**BASE, "tie_word_embeddings": True, "rope_interleave": False})
    assert gpt_config_from_hf(hf_config_from_gpt(cfg)) == cfg
    entries = DEEPSEEK_V3.tensor_map(cfg)
    with torch.device("meta"):
        names = {n for n, _ in MoEGPT(cfg).named_parameters()}
    assert names <= {e.ours for e in entries} and len({e.ours for e in entries}) == len(entries)


@pytest.mark.integration
def test_a_stored_multi_token_prediction_block_is_left_out_with_a_warning(saved, tmp_path):
    """Published DeepSeek-V3 checkpoints store their multi-token-prediction block after the
    decoder's (``model.layers.{num_hidden_layers}.``, ``num_nextn_predict_layers``): left out with
    a warning naming it, as transformers leaves it out; without the config's count, refused."""
    import shutil

    from safetensors.torch import save_file

    path, _ = saved
    mtp = tmp_path / "mtp"
    shutil.copytree(path, mtp)
    config = json.loads((mtp / "config.json").read_text())
    L = config["num_hidden_layers"]
    gen = torch.Generator().manual_seed(5)
    extra = {f"model.layers.{L}.eh_proj.weight": torch.randn(4, 8, generator=gen),
             f"model.layers.{L}.enorm.weight": torch.randn(4, generator=gen)}
    save_file(extra, mtp / "model-mtp.safetensors")
    index = json.loads((mtp / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in extra})
    (mtp / "model.safetensors.index.json").write_text(json.dumps(index))
    config["num_nextn_predict_layers"] = 1
    (mtp / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=rf"2 tensor\(s\) under model\.layers\.{L}\.\* are not loaded: "
                                        "DeepSeek-V3's multi-token-prediction block"):
        got = gpt_from_hf(mtp)
    want = gpt_from_hf(path)
    for (name, a), (_, b) in zip(want.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    config["num_nextn_predict_layers"] = 0
    (mtp / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"does not know: \['model\.layers\.{L}\.eh_proj\.weight'"):
        gpt_from_hf(mtp)
