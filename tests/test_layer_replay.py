"""Router replay (``moeflow.layer.replay``): recorded expert choices pin a later forward's routing
(issue 9, first step); in one process and under expert parallelism on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import moeflow
from moeflow.models import GPTConfig, MoEGPT
from moeflow.parallel import expert_parallel

from helpers import seeded_layer, spawn_ranks


def gpt(**kw) -> MoEGPT:
    base = dict(vocab_size=50, dim=32, n_layers=2, n_heads=4, max_seq_len=16, moe_every=1, num_experts=6,
                top_k=2, expert_hidden=16, capacity_factor=1.0)
    return MoEGPT(GPTConfig(**{**base, **kw}))


@pytest.mark.reference
def test_replay_reproduces_the_recorded_forward(gen) -> None:
    """After the recording, the routers' selection biases (aux-loss-free balancing: they move
    the choice of experts, not the weights) are scrambled, so a free forward picks other experts
    and gives another output; under replay the forward is the recorded one, bit for bit (a
    replay that did nothing would give the free output)."""
    model = gpt(router=moeflow.RouterConfig(bias_update_rate=1e-3)).double().eval()
    idx = torch.randint(0, 50, (3, 16), generator=gen)
    with moeflow.record_routing(model) as tape:
        ref = model(idx)
    assert sorted(tape.calls) == ["layers.0.ffn", "layers.1.ffn"] and tape.calls["layers.0.ffn"][0].shape == (48, 2)
    with torch.no_grad():
        for layer in moeflow.moe_layers(model):
            layer.router.expert_bias.copy_(torch.randn(6, generator=gen, dtype=torch.float64) * 5)
    with moeflow.record_routing(model) as free:
        free_out = model(idx)
    assert all(not torch.equal(a[0], b[0]) for a, b in zip(free.calls.values(), tape.calls.values()))
    assert not torch.allclose(free_out, ref)
    with moeflow.replay_routing(model, tape):
        again = model(idx)
    assert torch.equal(again, ref)


@pytest.mark.reference
def test_replay_pins_experts_under_changed_weights_and_noise(gen) -> None:
    model = gpt(router=moeflow.RouterConfig(noise_std=1.0)).double().train()
    idx = torch.randint(0, 50, (2, 16), generator=gen)
    with moeflow.record_routing(model) as tape:
        model(idx)
    with torch.no_grad():  # the policy moved on: routing would change without replay
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    with moeflow.record_routing(model) as free:
        model(idx)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(free.calls.values(), tape.calls.values()))
    # record and replay cannot nest on the same layers: check the replayed ids through last_counts_E
    with moeflow.replay_routing(model, tape):
        loss = model(idx).square().mean()
        counts = [layer.last_counts_E.clone() for layer in moeflow.moe_layers(model)]
    for c, rec in zip(counts, tape.calls.values()):
        assert torch.equal(c, torch.bincount(rec[0].flatten(), minlength=6))
    (loss + moeflow.aux_loss(model)).backward()
    for layer in moeflow.moe_layers(model):  # the router still learns from the replayed choice
        assert layer.router.linear.weight.grad.abs().sum() > 0


@pytest.mark.reference
def test_tape_saves_and_loads(tmp_path, gen) -> None:
    model = gpt().eval()
    idx = torch.randint(0, 50, (2, 8), generator=gen)
    with moeflow.record_routing(model) as tape:
        model(idx)
        model(idx[:1])
    tape.save(tmp_path / "t.safetensors")
    back = moeflow.RoutingTape.load(tmp_path / "t.safetensors")
    assert back.calls.keys() == tape.calls.keys()
    for name in tape.calls:
        assert len(back.calls[name]) == 2 and all(torch.equal(a, b) for a, b in zip(back.calls[name], tape.calls[name]))


@pytest.mark.reference
def test_replay_errors_name_the_problem(gen) -> None:
    model = gpt().eval()
    idx = torch.randint(0, 50, (2, 8), generator=gen)
    with moeflow.record_routing(model) as tape:
        model(idx)
    with moeflow.replay_routing(model, tape), pytest.raises(ValueError, match="shape"):
        model(idx[:1])
    with moeflow.replay_routing(model, tape), pytest.raises(ValueError, match="more often than recorded"):
        model(idx)
        model(idx)
    bad = moeflow.RoutingTape({n: [c[0] + 10] for n, c in tape.calls.items()})
    with moeflow.replay_routing(model, bad), pytest.raises(ValueError, match="in \\[0, 6\\)"):
        model(idx)
    dup = moeflow.RoutingTape({n: [c[0][:, :1].repeat(1, 2)] for n, c in tape.calls.items()})
    with moeflow.replay_routing(model, dup), pytest.raises(ValueError, match="repeat an expert"):
        model(idx)
    with pytest.raises(ValueError, match="no calls for MoE layer"), moeflow.replay_routing(model, moeflow.RoutingTape()):
        model(idx)
    with pytest.raises(RuntimeError, match="already"), moeflow.record_routing(model), moeflow.record_routing(model):
        pass
    with pytest.raises(TypeError, match="RoutingTape"):
        moeflow.replay_routing(model, {})


@pytest.mark.reference
def test_load_stats_sum_the_last_training_calls(gen) -> None:
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, load_window=3)
    xs = [torch.randn(n, 8, generator=gen) for n in (5, 6, 7, 8)]
    seen = []
    for x in xs:
        layer(x)
        seen.append(layer.last_counts_E.clone())
    assert torch.equal(layer.load_stats(), sum(seen[1:]))  # the window keeps the last 3 calls
    assert int(layer.load_stats().sum()) == 2 * (6 + 7 + 8)
    layer.eval()(xs[0])  # evaluation calls are not training load
    assert torch.equal(layer.load_stats(), sum(seen[1:]))
    one = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, load_window=1)
    for x in xs:
        one(x)
    assert int(one.load_stats().sum()) == 2 * 8  # the smallest window keeps the last call only
    with pytest.raises(RuntimeError, match="load_window"):
        moeflow.MoE(dim=8, hidden=8, num_experts=4).load_stats()
    with pytest.raises(ValueError, match="load_window"):
        moeflow.MoE(dim=8, hidden=8, num_experts=4, load_window=-1)


# ----------------------------------------------------------------------------- under expert parallelism

D = 8


def _case_replay(rank: int, world: int) -> None:
    """Router replay under expert parallelism: each rank records and replays its own tokens;
    the replayed forward equals the recorded one, also after the router weights moved."""
    ep = expert_parallel(seeded_layer(8, 2, 1.0, "position", "combine", seed=600))
    x = torch.randn(5 + rank, D, generator=torch.Generator().manual_seed(600 + rank), dtype=torch.float64)
    with moeflow.record_routing(ep) as tape:
        ref = ep(x)
    with moeflow.replay_routing(ep, tape):
        torch.testing.assert_close(ep(x), ref, rtol=0, atol=0)
    with torch.no_grad():
        ep.router.linear.weight.add_(torch.randn(ep.router.linear.weight.shape, dtype=torch.float64,
                                                 generator=torch.Generator().manual_seed(601)))
    with moeflow.replay_routing(ep, tape):
        ep(x)
    assert torch.equal(ep.last_counts_E, torch.bincount(tape.calls[""][0].flatten(), minlength=8))


CASES = {"replay": _case_replay}  # looked up by the spawned ranks


@pytest.mark.distributed
def test_router_replay_under_expert_parallelism():
    spawn_ranks(2, __name__, "replay")


@pytest.mark.reference
def test_each_saved_tape_loads_its_own_calls(tmp_path, gen) -> None:
    """Two different tapes saved to two files load back as themselves (a loader that read some
    other file would give one of them wrong); a layer name with ``#`` in it survives the
    ``<layer>#<call>`` keys; the repr counts layers and calls."""
    a = moeflow.RoutingTape({"layers.0.ffn": [torch.randint(0, 6, (4, 2), generator=gen) for _ in range(3)],
                             "odd#name": [torch.randint(0, 6, (2, 2), generator=gen)]})
    b = moeflow.RoutingTape({"layers.1.ffn": [torch.randint(0, 6, (5, 2), generator=gen)]})
    assert repr(a) == "RoutingTape(2 layers, 4 calls)" and repr(b) == "RoutingTape(1 layers, 1 calls)"
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    for tape, name in ((a, "a"), (b, "b")):
        back = moeflow.RoutingTape.load(tmp_path / f"{name}.safetensors")
        assert back.calls.keys() == tape.calls.keys()
        for layer, calls in tape.calls.items():
            assert len(back.calls[layer]) == len(calls) and all(torch.equal(x, y) for x, y in zip(back.calls[layer], calls))


@pytest.mark.reference
def test_replayed_ids_are_checked_one_rule_at_a_time(gen) -> None:
    """Each rule of the replayed ids alone: int64 (an int32 tensor is refused), every id below
    the expert count (E itself is refused), distinct within a row for top_k > 1."""
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2)
    x = torch.randn(3, 8, generator=gen)
    good = torch.tensor([[0, 1], [2, 3], [3, 0]])
    cases = [(good.to(torch.int32), TypeError, "int64"), (torch.tensor([[0, 1], [4, 3], [3, 0]]), ValueError, r"in \[0, 4\)"),
             (torch.tensor([[0, 1], [2, 2], [3, 0]]), ValueError, "repeat an expert")]
    for ids, error, match in cases:
        with moeflow.replay_routing(layer, moeflow.RoutingTape({"": [ids]})), pytest.raises(error, match=match):
            layer(x)
    # calls are replayed one after the other, none skipped
    other = torch.tensor([[1, 2], [1, 3], [1, 0]])
    with moeflow.replay_routing(layer, moeflow.RoutingTape({"": [good, other, good]})):
        for ids in (good, other, good):
            layer(x)
            assert torch.equal(layer.last_counts_E, torch.bincount(ids.flatten(), minlength=4))


@pytest.mark.reference
def test_recording_appends_to_the_tape_it_is_given(gen) -> None:
    """``record_routing(model, tape)`` appends to that tape (after what it already holds); the
    tape keeps int64 copies (an int32 choice is stored as int64, a later change of the recorded
    tensor does not reach the tape)."""
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2)
    earlier = torch.tensor([[0, 1]])
    tape = moeflow.RoutingTape({"": [earlier]})
    x = torch.randn(3, 8, generator=gen)
    with moeflow.record_routing(layer, tape) as got:
        layer(x)
    assert got is tape and len(tape.calls[""]) == 2 and torch.equal(tape.calls[""][0], earlier)
    assert torch.equal(torch.bincount(tape.calls[""][1].flatten(), minlength=4), layer.last_counts_E)
    ids = torch.tensor([[3, 2]], dtype=torch.int32)
    tape.record("other", ids)
    ids[0, 0] = 1
    assert tape.calls["other"][0].dtype == torch.int64 and tape.calls["other"][0].tolist() == [[3, 2]]
