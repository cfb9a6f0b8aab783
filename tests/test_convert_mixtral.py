"""Mixtral weights between Hugging Face transformers and moeflow's MoE GPT."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (moeflow[hf])")

import moeflow  # noqa: E402
from moeflow.checkpoint import CheckpointError  # noqa: E402
from moeflow.cli.main import main  # noqa: E402
from moeflow.models import MoEGPT, gpt_config  # noqa: E402
from moeflow.convert.mixtral import gpt_from_hf, gpt_to_hf, state_dict_from_hf  # noqa: E402

pytestmark = pytest.mark.integration


def tiny_mixtral(gen: torch.Generator, **kw):
    cfg = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager", **kw)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # HF builds experts with torch.empty: draw every weight
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def test_import_gives_the_same_logits_and_gradients(tmp_path, gen) -> None:
    hf = tiny_mixtral(gen)
    hf.save_pretrained(tmp_path / "hf")
    ours = gpt_from_hf(tmp_path / "hf").eval()
    idx = torch.randint(0, 97, (2, 11), generator=gen)
    ref = hf(idx).logits
    got = ours(idx)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, rel
    ref.square().mean().backward()
    got.square().mean().backward()
    g_ref = hf.model.layers[1].mlp.experts.down_proj.grad  # [E, D, H]
    g_got = ours.layers[1].ffn.experts.w_out.grad.transpose(1, 2)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours.embed.weight.grad, hf.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-6)


def test_fused_in_memory_layout_reads_too(gen) -> None:
    hf = tiny_mixtral(gen)
    from moeflow.convert.mixtral import gpt_config_from_hf

    cfg = gpt_config_from_hf(hf.config.to_dict())
    model = MoEGPT(cfg)
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), strict=False)
    idx = torch.randint(0, 97, (1, 9), generator=gen)
    torch.testing.assert_close(model.eval()(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_round_trip_through_the_cli_is_exact(tmp_path, gen) -> None:
    hf = tiny_mixtral(gen)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "mf")]) == 0
    assert main(["convert", str(tmp_path / "mf"), "--to-hf", str(tmp_path / "back")]) == 0
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back")
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_trained_tiny_model_exports_to_transformers(tmp_path, gen) -> None:
    model = MoEGPT(gpt_config("tiny", vocab_size=64, n_layers=2, max_seq_len=32)).eval()
    gpt_to_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    idx = torch.randint(0, 64, (2, 16), generator=gen)
    torch.testing.assert_close(hf(idx).logits, model(idx), rtol=1e-5, atol=1e-5)
    back = gpt_from_hf(tmp_path / "hf").eval()  # tied embeddings come back tied
    assert back.lm_head.weight is back.embed.weight
    torch.testing.assert_close(back(idx), model(idx), rtol=0, atol=0)


def test_conversion_errors_name_the_problem(tmp_path, gen) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        gpt_from_hf(tmp_path)
    qwen = transformers.Qwen2MoeConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=50)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps(qwen.to_dict()))
    with pytest.raises(CheckpointError, match="model_type 'qwen2_moe'"):
        gpt_from_hf(tmp_path / "q")
    hf = tiny_mixtral(gen, hidden_act="gelu")
    hf.save_pretrained(tmp_path / "g")
    with pytest.raises(CheckpointError, match="hidden_act"):
        gpt_from_hf(tmp_path / "g")
    with pytest.raises(ValueError, match="moe_every"):
        gpt_to_hf(MoEGPT(gpt_config("tiny", vocab_size=16, moe_every=2)), tmp_path / "x")
    assert main(["convert", "--from-hf", str(tmp_path / "q"), str(tmp_path / "y")]) == 2
    # aux-loss-free balancing's bias changes the choice of experts: Mixtral cannot hold it
    biased = MoEGPT(gpt_config("tiny", vocab_size=16, n_layers=1,
                               router=moeflow.RouterConfig(scoring="topk_softmax", bias_update_rate=0.01)))
    gpt_to_hf(biased, tmp_path / "zero-bias")  # a zero bias changes nothing: exported
    with torch.no_grad():
        biased.layers[0].ffn.router.expert_bias[0] = 0.5
    with pytest.raises(ValueError, match="expert_bias is nonzero"):
        gpt_to_hf(biased, tmp_path / "b")
