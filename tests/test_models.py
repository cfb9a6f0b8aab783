"""The models (``moeflow.models``): their configs validate on construction (no compute), and on CPU
the MoE GPT and the vision MoE (shapes, causality, generation, parameters)."""

from __future__ import annotations

import json

import pytest
import torch

import moeflow
from moeflow.models import GPT_PRESETS, GPTConfig, MoEGPT, ViTMoEConfig, VisionMoE, gpt_config

from helpers import small_gpt


# ----------------------------------------------------------------------------- configs


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
def test_every_preset_builds_a_valid_config(name: str) -> None:
    cfg = gpt_config(name, vocab_size=256)
    assert cfg.vocab_size == 256 and cfg.dim % cfg.n_heads == 0
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    # the dict is what a checkpoint gives back after JSON (resume compares the two)
    assert json.loads(json.dumps(cfg.to_dict())) == cfg.to_dict()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(n_heads=3), "n_heads"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(top_k=9), "top_k"),
        (dict(moe_every=-1), "moe_every"),
        (dict(dropout=1.0), "dropout"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(norm_eps=0.0), "norm_eps"),
    ],
)
def test_gpt_config_rejects_bad_values(fields: dict, match: str) -> None:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, num_experts=8)
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**base, **fields})


@pytest.mark.unit
def test_gpt_config_from_dict_rejects_unknown_fields() -> None:
    d = gpt_config("tiny", vocab_size=10).to_dict()
    d["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        GPTConfig.from_dict(d)


@pytest.mark.unit
def test_unknown_preset_is_named() -> None:
    with pytest.raises(ValueError, match="preset.*'huge'"):
        gpt_config("huge")


@pytest.mark.unit
def test_vit_config_checks_patch_and_heads() -> None:
    with pytest.raises(ValueError, match="patch_size"):
        ViTMoEConfig(image_size=8, patch_size=3, num_classes=10)
    with pytest.raises(ValueError, match="heads"):
        ViTMoEConfig(image_size=8, patch_size=2, num_classes=10, dim=30, heads=4)


# ----------------------------------------------------------------------------- on CPU


@pytest.mark.reference
def test_gpt_places_moe_blocks_every_n(gen) -> None:
    model = small_gpt(n_layers=4, moe_every=2)
    kinds = [type(b.ffn).__name__ for b in model.layers]
    assert kinds == ["DenseFFN", "MoE", "DenseFFN", "MoE"]
    assert len(moeflow.moe_layers(small_gpt(moe_every=0))) == 0
    assert len(moeflow.moe_layers(small_gpt(moe_every=1))) == 3


@pytest.mark.reference
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


@pytest.mark.reference
def test_tied_embeddings_share_one_tensor() -> None:
    model = small_gpt(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "embed.weight" in names


@pytest.mark.reference
def test_generate_appends_tokens_greedy_is_deterministic(gen) -> None:
    model = small_gpt().eval()
    idx = torch.randint(0, 61, (2, 5), generator=gen)
    a = model.generate(idx, 30, temperature=0)  # longer than max_seq_len: the context is cropped
    b = model.generate(idx, 30, temperature=0)
    assert a.shape == (2, 35) and torch.equal(a, b) and torch.equal(a[:, :5], idx)
    s = model.generate(idx, 4, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(1))
    assert s.shape == (2, 9) and int(s.max()) < 61


@pytest.mark.reference
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


@pytest.mark.reference
def test_active_parameters_count_k_of_e_experts() -> None:
    model = small_gpt(moe_every=1, num_experts=4, top_k=1)
    total, active = model.num_parameters()
    expert = sum(p.numel() for p in moeflow.moe_layers(model)[0].experts.parameters()) * 3
    assert total - active == expert * 3 // 4


@pytest.mark.unit
@pytest.mark.parametrize("moe_every", [0, 1, 2])
def test_parameter_counts_are_the_models_and_k_of_e_experts_per_token(gen, moe_every) -> None:
    """``num_parameters``: the total counts every parameter once (a tied head is the embedding);
    ``active`` is the rest plus ``k / E`` of the experts' (a dense model: the total), both ints,
    on random ``E``, ``k`` and tying."""
    E = int(torch.randint(2, 7, (1,), generator=gen))
    k = int(torch.randint(1, E + 1, (1,), generator=gen))
    tie = bool(torch.randint(0, 2, (1,), generator=gen))
    model = small_gpt(moe_every=moe_every, num_experts=E, top_k=k, tie_embeddings=tie)
    total, active = model.num_parameters()
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    expert = sum(p.numel() for layer in moeflow.moe_layers(model) for p in layer.experts.parameters())
    assert type(total) is int and type(active) is int
    assert total == sum(unique.values())
    assert active == total - expert + expert // E * k
    assert (active == total) == (moe_every == 0 or k == E) and (expert > 0) == (moe_every > 0)


@pytest.mark.unit
def test_the_model_is_built_in_the_dtype_and_on_the_device_asked_for_with_its_embedding_dropout(gen) -> None:
    """``MoEGPT(config, dtype=, device=)``: every parameter in that dtype and every parameter
    and buffer on that device; ``config.dropout`` drops the embeddings' output in training
    (zeros, the rest scaled by ``1 / (1 - p)``) and not in eval."""
    for kw in (dict(dtype=torch.float64), dict(device="meta"), dict(dtype=torch.bfloat16, device="meta")):
        model = MoEGPT(small_gpt().config, **kw)  # type: ignore[arg-type]
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            assert t.device.type == kw.get("device", "cpu"), name
        for name, p in model.named_parameters():  # (a router's balance buffers stay fp32)
            assert p.dtype == kw.get("dtype", torch.float32), name
    model = small_gpt(dropout=0.5)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.embed.register_forward_hook(lambda mod, args, out: seen.append(("embed", out.detach())))
    model.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(("block", args[0].detach())))
    idx = torch.randint(0, 61, (2, 12), generator=gen)
    for train in (True, False):
        seen.clear()
        model.train(train)
        model(idx)
        (_, emb), (_, x) = seen
        if train:
            kept = x != 0
            assert 0 < kept.float().mean() < 1 and torch.allclose(x[kept], 2 * emb[kept])
        else:
            assert torch.equal(x, emb)


@pytest.mark.reference
def test_tiny_preset_loss_starts_near_uniform(gen) -> None:
    model = MoEGPT(gpt_config("tiny", vocab_size=256))
    idx = torch.randint(0, 256, (2, 33), generator=gen)
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2


@pytest.mark.reference
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



@pytest.mark.reference
def test_every_tensor_the_model_makes_names_its_device():
    """As ``test_layer_moe``'s check for the layer, for the whole MoE GPT: training loss and
    backward, then KV-cached generation of a left-padded batch, with ``meta`` as the default
    device and everything real on the CPU (a constructor without a device would make a meta
    tensor and fail against them; the custom autograd Functions' backwards are out of its
    reach, as the layer's check says)."""
    from moeflow.models.generation import generate

    torch.manual_seed(0)
    model = small_gpt()
    idx = torch.randint(0, 61, (2, 8))
    with torch.device("meta"):
        (model.loss(idx, idx) + moeflow.aux_loss(model)).backward()
        model.eval()
        out = model.generate(idx, max_new_tokens=3, temperature=0)
        ragged = generate(model, [idx[0].tolist(), idx[1, :5].tolist()], 3, temperature=0)
    assert out.device.type == "cpu" and out.shape == (2, 11)
    assert ragged.tokens[0] == out[0, 8:].tolist() and len(ragged.tokens[1]) == 3
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters() if p.requires_grad)


@pytest.mark.unit
def test_model_modules_import_one_way():
    """The model calls generation (``MoEGPT.generate``) and generation reads the model through
    ``moeflow.models.decoding.Decoder``: no generation module imports ``moeflow.models.gpt``
    (anywhere in the file, function bodies included), and the blocks and the config sit below
    the model."""
    import ast
    from pathlib import Path

    import moeflow.models as models

    def imported(name: str) -> set[str]:
        tree = ast.parse((Path(models.__file__).parent / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        return {m for m in found if m.startswith("moeflow.models")}

    for name in ("decoding", "generation", "compiled_decode", "kv_cache", "blocks", "gpt_config"):
        assert "moeflow.models.gpt" not in imported(name), name
    assert imported("gpt_config") == set() and "moeflow.models.gpt" not in imported("blocks")
    assert isinstance(small_gpt(), models.generation.Decoder)


class _PerTokenHead(torch.nn.Linear):
    """An output projection that computes the per-token losses itself (as the
    vocabulary-parallel head does), recording what it was given."""

    def cross_entropy(self, h_TD: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        self.given = (h_TD, targets_T)
        return torch.nn.functional.cross_entropy(self(h_TD), targets_T, reduction="none")


@pytest.mark.reference
def test_the_loss_is_the_mean_next_token_cross_entropy_in_at_least_fp32(gen) -> None:
    """``loss``: the mean cross-entropy over every position, fp32 for a bf16 model (its logits
    cast up, not the loss rounded to bf16); a head with a ``cross_entropy`` method is handed the
    flat hidden states and targets and its per-token losses are averaged (the idx checked as
    in ``forward``)."""
    model = small_gpt().double()
    B, S = 3, int(torch.randint(2, 20, (), generator=gen))
    idx, targets = torch.randint(0, 61, (2, B, S), generator=gen)
    want = -torch.log_softmax(model(idx), -1).gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(model.loss(idx, targets), want, rtol=1e-12, atol=1e-12)
    bf16 = small_gpt().to(torch.bfloat16)
    loss = bf16.loss(idx, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(bf16(idx).float().flatten(0, 1),
                                                                       targets.flatten()), rtol=0, atol=0)
    head = _PerTokenHead(32, 61, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
    model.lm_head = head
    torch.testing.assert_close(model.loss(idx, targets), want, rtol=1e-12, atol=1e-12)
    h_TD, targets_T = head.given
    assert torch.equal(h_TD, model.hidden_states(idx).flatten(0, 1)) and torch.equal(targets_T, targets.flatten())
    with pytest.raises(ValueError, match="sequence length 25 exceeds max_seq_len=24"):
        model.loss(torch.zeros(1, 25, dtype=torch.long), torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.reference
def test_new_cache_takes_one_column_up_to_max_seq_len(gen) -> None:
    """``new_cache``: from one column (a one-token prompt's whole generation) to ``max_seq_len``;
    a window only where a block slides; zeroed on request; other capacities refused by name."""
    model = small_gpt().double().eval()
    idx = torch.randint(0, 61, (2, 1), generator=gen)
    cache = model.new_cache(torch.zeros(2, dtype=torch.long), 1)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_cached(idx, cache), model(idx)[:, -1], rtol=1e-12, atol=1e-12)
    assert cache.capacity == 1 and cache.window is None
    full = model.new_cache(torch.zeros(2, dtype=torch.long), 24, zeroed=True)
    assert full.capacity == 24 and all(t.eq(0).all() and t.dtype == torch.float64 for t in (*full.k, *full.v))
    for capacity, match in ((0, "capacity must be >= 1"), (25, "capacity=25 exceeds max_seq_len=24")):
        with pytest.raises(ValueError, match=match):
            model.new_cache(torch.zeros(2, dtype=torch.long), capacity)
