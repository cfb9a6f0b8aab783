"""Tier 2: the models on CPU (shapes, causality, generation, parameters), and global-norm clipping."""

from __future__ import annotations

import pytest
import torch

import moeflow
from moeflow.models import GPTConfig, MoEGPT, ViTMoEConfig, VisionMoE, gpt_config
from moeflow.parallel import clip_grad_norm_


def small_gpt(**kw) -> MoEGPT:
    base = dict(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=24, moe_every=2,
                num_experts=4, top_k=2, expert_hidden=24)
    return MoEGPT(GPTConfig(**{**base, **kw}))


def test_gpt_places_moe_blocks_every_n(gen) -> None:
    model = small_gpt(n_layers=4, moe_every=2)
    kinds = [type(b.ffn).__name__ for b in model.layers]
    assert kinds == ["DenseFFN", "MoE", "DenseFFN", "MoE"]
    assert len(moeflow.moe_layers(small_gpt(moe_every=0))) == 0
    assert len(moeflow.moe_layers(small_gpt(moe_every=1))) == 3


def test_gpt_is_causal_and_trains_every_parameter(gen) -> None:
    model = small_gpt(capacity_factor=0.0).double()
    idx = torch.randint(0, 61, (3, 20), generator=gen)
    logits = model(idx)
    assert logits.shape == (3, 20, 61) and logits.dtype == torch.float64
    changed = idx.clone()
    changed[:, 12:] = torch.randint(0, 61, (3, 8), generator=gen)
    # dropless routing is per token, so a future token cannot change a past position
    torch.testing.assert_close(model(changed)[:, :12], logits[:, :12], rtol=1e-12, atol=1e-12)
    loss = model.loss(idx[:, :-1], idx[:, 1:]) + moeflow.aux_loss(model)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_tied_embeddings_share_one_tensor() -> None:
    model = small_gpt(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "embed.weight" in names


def test_generate_appends_tokens_greedy_is_deterministic(gen) -> None:
    model = small_gpt().eval()
    idx = torch.randint(0, 61, (2, 5), generator=gen)
    a = model.generate(idx, 30, temperature=0)  # longer than max_seq_len: the context is cropped
    b = model.generate(idx, 30, temperature=0)
    assert a.shape == (2, 35) and torch.equal(a, b) and torch.equal(a[:, :5], idx)
    s = model.generate(idx, 4, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    assert s.shape == (2, 9) and int(s.max()) < 61


def test_gpt_bad_input_names_the_problem() -> None:
    model = small_gpt()
    with pytest.raises(TypeError, match="idx"):
        model(torch.randn(2, 5))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one token"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 1, temperature=-1.0)
    with pytest.raises(TypeError, match="GPTConfig"):
        MoEGPT({"dim": 3})  # type: ignore[arg-type]


def test_active_parameters_count_k_of_e_experts() -> None:
    model = small_gpt(moe_every=1, num_experts=4, top_k=1)
    total, active = model.num_parameters()
    expert = sum(p.numel() for p in moeflow.moe_layers(model)[0].experts.parameters()) * 3
    assert total - active == expert * 3 // 4


def test_tiny_preset_loss_starts_near_uniform(gen) -> None:
    model = MoEGPT(gpt_config("tiny", vocab_size=256))
    idx = torch.randint(0, 256, (2, 33), generator=gen)
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2


@pytest.mark.parametrize("router", ["linear", "cosine"])
def test_vision_moe_shapes_and_gradients(gen, router: str) -> None:
    cfg = ViTMoEConfig(image_size=8, patch_size=2, in_channels=1, num_classes=10, dim=32, depth=2, heads=4,
                       mlp_hidden=16, moe_every=1, num_experts=4, top_k=2,
                       router=moeflow.RouterConfig(kind=router, cosine_proj_dim=8))
    model = VisionMoE(cfg)
    x = torch.rand(5, 1, 8, 8, generator=gen)
    logits = model(x)
    assert logits.shape == (5, 10)
    (logits.square().mean() + moeflow.aux_loss(model)).backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="images"):
        model(torch.rand(5, 3, 8, 8))


def test_clip_grad_norm_matches_torch_on_one_process(gen) -> None:
    model = small_gpt()
    idx = torch.randint(0, 61, (2, 10), generator=gen)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    twin = small_gpt()
    twin.load_state_dict(model.state_dict())
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(model, 0.05)
    ref = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.05)
    torch.testing.assert_close(norm.float(), ref.float(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(model, 0.0)
