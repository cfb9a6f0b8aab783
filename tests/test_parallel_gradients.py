"""Gradients of sharded and replicated parameters (``moeflow.parallel.gradients``): DDP averages
the dense gradients only and FSDP2 ignores the experts (2 and 4 gloo ranks), reduced expert
gradients are those of the mean loss, missing gradients count as zeros, and the global-norm
clipping equals torch's in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moeflow.parallel import all_reduce_gradients, clip_grad_norm_, expert_parallel, make_groups

from helpers import seeded_layer, small_gpt, spawn_ranks

D = 8


@pytest.mark.reference
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


@pytest.mark.unit
def test_clipping_makes_its_tensors_on_the_parameters_device(gen) -> None:
    """The norm is summed on the parameters' device, not on the default one: on a GPU a CPU
    accumulator is a CPU tensor in NCCL's all-reduce (a crash), and a default device set by the
    caller must not move it either. A ``meta`` default device stands for the other device here."""
    model = small_gpt()
    idx = torch.randint(0, 61, (2, 10), generator=gen)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    ref = clip_grad_norm_(twin, 0.05)
    with torch.device("meta"):
        norm = clip_grad_norm_(model, 0.05)
    assert norm.device.type == "cpu" and float(norm) == pytest.approx(float(ref), rel=1e-12)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.reference
def test_clipping_counts_every_gradient_after_an_expert_weight_without_one(gen) -> None:
    """An expert weight without a gradient (frozen, or not reached this step) counts as zero and
    the ones after it still count: the norm and the clipped gradients are torch's over the
    gradients present."""
    from moeflow.parallel.gradients import expert_parameters

    model = small_gpt()
    idx = torch.randint(0, 61, (2, 10), generator=gen)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    experts = expert_parameters(model)
    assert len(experts) > 1
    experts[0].grad = None
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    norm = clip_grad_norm_(model, 0.05)
    ref = torch.nn.utils.clip_grad_norm_([q for q in twin.parameters() if q.grad is not None], 0.05)
    assert float(norm) == pytest.approx(float(ref), rel=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.unit
def test_clipping_scales_low_precision_gradients_by_the_factor_in_their_dtype(gen) -> None:
    """The factor ``max_norm / (norm + 1e-6)`` is rounded to the gradients' dtype before it
    scales them, as torch's ``clip_grad_norm_`` scales by a factor of the gradients' dtype: bf16
    and fp16 gradients are ``g * factor.to(dtype)`` bit for bit (the fp64 factor, unrounded, gives
    other bits for 4-54% of them, by the factor)."""
    for dtype in (torch.bfloat16, torch.float16):
        model = torch.nn.Linear(32, 32, dtype=dtype)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype)
        before = [p.grad.clone() for p in model.parameters()]
        norm = clip_grad_norm_(model, 0.5)
        factor = (0.5 / (norm + 1e-6)).clamp(max=1.0)
        assert norm.dtype == torch.float64 and float(factor) < 1
        for p, g in zip(model.parameters(), before):
            assert torch.equal(p.grad, g * factor.to(dtype)), dtype


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipping_leaves_gradients_below_the_limit_untouched_and_scales_those_above_to_it(gen, dtype) -> None:
    """Both sides of clipping: gradients whose global norm is below ``max_norm`` (by half, and by
    0.1%) stay bit for bit what they were, never scaled up to the limit; above it (3x, and by
    0.1%) every gradient is scaled by one factor, ``max_norm / (norm + 1e-6)`` (torch's), so the norm after
    is ``max_norm`` and the direction is kept. The returned norm is the norm before, both times."""
    model = small_gpt().to(dtype)
    idx = torch.randint(0, 61, (2, 10), generator=gen)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    before = _grads(model)
    norm = float(torch.cat([g.double().flatten() for g in before]).norm())
    for limit in (2 * norm, norm * 1.001):
        got = clip_grad_norm_(model, limit)
        assert float(got) == pytest.approx(norm, rel=1e-12)
        assert all(torch.equal(a, b) for a, b in zip(_grads(model), before)), limit
    rtol = 1e-6 if dtype == torch.float32 else 1e-12
    for limit in (norm / 3, norm * 0.999):
        for p, g in zip((p for p in model.parameters() if p.grad is not None), before):
            p.grad = g.clone()
        assert float(clip_grad_norm_(model, limit)) == pytest.approx(norm, rel=1e-12)
        after = _grads(model)
        for a, b in zip(after, before):
            torch.testing.assert_close(a, b * (limit / (norm + 1e-6)), rtol=rtol, atol=0)
        assert float(torch.cat([g.double().flatten() for g in after]).norm()) == pytest.approx(limit, rel=1e-6)


@pytest.mark.reference
def test_clipping_counts_and_scales_vocab_shards_and_experts_like_any_gradient(gen) -> None:
    """In one process the sharded parameters (experts, vocabulary shards) are whole, so clipping
    is torch's over every gradient: a vocabulary shard or an expert left out of the norm, or left
    unscaled, would differ. The tags are set by hand (``vocab_parallel`` needs a group)."""
    from moeflow.parallel import dense_parameters, expert_parameters, vocab_parameters

    model = small_gpt().double()
    model.embed.weight.moeflow_vocab_shard = True
    idx = torch.randint(0, 61, (2, 10), generator=gen)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    assert vocab_parameters(model) == [model.embed.weight]
    assert expert_parameters(model) and all(getattr(p, "moeflow_expert", False) for p in expert_parameters(model))
    kinds = [{id(p) for p in f(model)} for f in (dense_parameters, expert_parameters, vocab_parameters)]
    assert sum(map(len, kinds)) == len(list(model.parameters())) == len(set().union(*kinds))  # a partition
    before = _grads(model)
    norm = float(torch.cat([g.flatten() for g in before]).norm())
    limit = norm * (0.2 + 0.6 * float(torch.rand((), generator=gen)))
    assert float(clip_grad_norm_(model, limit)) == pytest.approx(norm, rel=1e-12)
    for a, b in zip(_grads(model), before):
        torch.testing.assert_close(a, b * (limit / (norm + 1e-6)), rtol=1e-12, atol=0)


def _case_ddp(rank: int, world: int) -> None:
    """DDP averages dense gradients only; expert gradients stay this rank's own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from moeflow.parallel import ddp_ignore_expert_parameters, expert_parameters

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(D, D, dtype=torch.float64), seeded_layer(8, 2, 0.0, "position", "combine", seed=5))
    expert_parallel(model)
    ignored = ddp_ignore_expert_parameters(model)
    assert ignored and all("experts" in n for n in ignored)
    ddp = DDP(model)
    x = torch.randn(10 + rank, D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    ddp(x).square().sum().backward()
    plain = copy.deepcopy(model)
    for p in plain.parameters():
        p.grad = None
    plain(x).square().sum().backward()  # same forward without DDP: the local gradients
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if name in ignored:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
        else:
            avg = q.grad.clone()
            dist.all_reduce(avg)
            torch.testing.assert_close(p.grad, avg / world, rtol=1e-10, atol=1e-12)
    assert len(expert_parameters(model)) == len(ignored)

    # with reduce_expert_gradients, every gradient is that of the mean loss over the ranks
    from moeflow.parallel import reduce_expert_gradients

    torch.manual_seed(5)
    ref = torch.nn.Sequential(torch.nn.Linear(D, D, dtype=torch.float64), seeded_layer(8, 2, 0.0, "position", "combine", seed=5))
    xs = [torch.randn(10 + r, D, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(world)]
    # each rank's loss is a sum over its rows; the group minimises their mean
    (sum(ref(xr).square().sum() for xr in xs) / world).backward()
    reduce_expert_gradients(model, make_groups(world))
    e = 8 // world
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        expected = ref_grads[name].grad
        if name in ignored:
            expected = expected[rank * e : (rank + 1) * e]
        torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-12, msg=name)


def _case_fsdp2(rank: int, world: int) -> None:
    """FSDP2 with the experts ignored: dense gradients averaged (sharded), experts local."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moeflow.parallel import fsdp_ignored_parameters

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(D, D, dtype=torch.float64), seeded_layer(8, 2, 0.0, "position", "combine", seed=5))
    expert_parallel(model)
    plain = copy.deepcopy(model)
    ignored = fsdp_ignored_parameters(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), ignored_params=ignored)
    x = torch.randn(6 + rank, D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    model(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if p in ignored:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
        else:
            avg = q.grad.clone()
            dist.all_reduce(avg)
            torch.testing.assert_close(p.grad.full_tensor(), avg / world, rtol=1e-10, atol=1e-12)


def _case_all_reduce_none_grads(rank: int, world: int) -> None:
    """Parameters without a gradient on some ranks count as zeros (same layout everywhere)."""
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2))
    (a if rank == 0 else b).sum().backward()
    all_reduce_gradients([a, b], None, average=False)
    assert a.grad.tolist() == [1.0] * 3 and b.grad.tolist() == [float(world - 1)] * 2


def _case_clip_both_sides(rank: int, world: int) -> None:
    """Clipping over ranks: the expert gradients are sharded, the dense ones replicated, so the
    global norm pools every rank's experts. Below it (by 1%) every gradient on every rank stays
    bit for bit; at a limit above each rank's own norm (dense + its experts) but below the
    global one, every rank still scales (a rank that looked at its own norm alone would not),
    all by one factor, and the norm after is the limit."""
    from moeflow.parallel import dense_parameters, expert_parameters

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(D, D, dtype=torch.float64), seeded_layer(8, 2, 0.0, "position", "combine", seed=5))
    expert_parallel(model)
    x = torch.randn(10 + rank, D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    model(x).square().sum().backward()
    all_reduce_gradients(dense_parameters(model), None)  # dense gradients replicated, as DDP leaves them
    # the gradients rescaled: dense ones of norm 0.3, each rank's experts of norm 1 (the model's
    # own put nearly all of the norm on one rank), so each rank's own norm (1.04) is well below
    # the global one (1.45)
    for params, target in ((dense_parameters(model), 0.3), (expert_parameters(model), 1.0)):
        scale = target / float(torch.cat([p.grad.flatten() for p in params]).norm())
        for p in params:
            p.grad.mul_(scale)
    before = _grads(model)
    dense = {id(p) for p in dense_parameters(model)}
    sq_dense = sum(float(p.grad.square().sum()) for p in model.parameters() if id(p) in dense)
    sq_own = torch.tensor(sum(float(p.grad.square().sum()) for p in model.parameters() if id(p) not in dense),
                          dtype=torch.float64)
    own = (sq_dense + float(sq_own)) ** 0.5
    dist.all_reduce(sq_own)
    norm = (sq_dense + float(sq_own)) ** 0.5
    owns = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(owns, torch.tensor(own, dtype=torch.float64))
    highest_own = max(float(o) for o in owns)
    assert highest_own < norm * 0.9, (owns, norm)  # the case needs a limit between the two
    assert float(clip_grad_norm_(model, norm * 1.01)) == pytest.approx(norm, rel=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), before))
    limit = (highest_own + norm) / 2
    assert float(clip_grad_norm_(model, limit)) == pytest.approx(norm, rel=1e-12)
    for a, b in zip(_grads(model), before):
        torch.testing.assert_close(a, b * (limit / (norm + 1e-6)), rtol=1e-12, atol=0)
    sq_after = torch.tensor(sum(float(p.grad.square().sum()) for p in model.parameters() if id(p) not in dense),
                            dtype=torch.float64)
    dist.all_reduce(sq_after)
    sq_after += sum(float(p.grad.square().sum()) for p in model.parameters() if id(p) in dense)
    assert float(sq_after) ** 0.5 == pytest.approx(limit, rel=1e-6)


def _case_groups(rank: int, world: int) -> None:
    """Each reduction reduces over the group it is given, not the whole world: over every rank,
    ``all_reduce_gradients`` averages (or sums) and ``sync_load_counts`` sums each router's load
    counts; over a group of this rank alone nothing changes, and clipping over it takes this
    rank's own norm. An empty parameter list is no call at all."""
    from moeflow.layer.moe import moe_layers
    from moeflow.parallel import sync_load_counts

    own = [dist.new_group([r]) for r in range(world)][rank]
    gen = torch.Generator().manual_seed(100 + rank)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in ((3, 2), (5,), (2, 2))]
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
    everyone = [g.clone() for g in grads]
    for g in everyone:
        dist.all_reduce(g)
    for group, average, expected in ((None, True, [g / world for g in everyone]), (None, False, everyone),
                                     (own, True, grads), (own, False, grads)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        all_reduce_gradients(params, group, average=average)
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12, msg=f"{group} {average}")
    all_reduce_gradients([], None)

    model = small_gpt(n_layers=4)
    layers = moe_layers(model)
    assert len(layers) == 2
    counts = [torch.randint(0, 50, (4,), generator=gen) for _ in layers]
    for layer, c in zip(layers, counts):
        layer.router.load_counts.copy_(c)
    sync_load_counts(model, own)
    assert all(torch.equal(layer.router.load_counts, c) for layer, c in zip(layers, counts))
    sync_load_counts(model, None)
    for layer, c in zip(layers, counts):
        total = c.clone()
        dist.all_reduce(total)
        assert torch.equal(layer.router.load_counts, total)

    # clipping over a group of one: the norm is this rank's own, whatever the other rank holds
    model = torch.nn.Sequential(torch.nn.Linear(D, D, dtype=torch.float64), seeded_layer(8, 2, 0.0, "position", "combine", seed=5))
    expert_parallel(model)
    x = torch.randn(10 + 5 * rank, D, generator=gen, dtype=torch.float64)
    model(x).square().sum().backward()
    local = float(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm())
    assert float(clip_grad_norm_(model, local * 2, own)) == pytest.approx(local, rel=1e-12)


def _case_expert_and_data_groups(rank: int, world: int) -> None:
    """Expert groups of 2 ranks, data groups of 2 across them: each expert's gradient, already
    summed over its expert group by the exchange's backward, is summed over its data group and
    divided by the world size, so with the dense gradients averaged (as DDP does) every
    gradient is that of the mean loss over all ranks. A data group of one rank (the DDP case)
    cannot tell a sum over it from an average, nor the world size from ``expert_size``."""
    groups = make_groups(2)
    assert (groups.expert_size, groups.data_size) == (2, world // 2)

    def build() -> torch.nn.Module:
        torch.manual_seed(7)
        return torch.nn.Sequential(torch.nn.Linear(D, D, dtype=torch.float64),
                                   seeded_layer(8, 2, 0.0, "position", "combine", seed=7))

    from moeflow.parallel import dense_parameters, expert_parameters, reduce_expert_gradients

    model = expert_parallel(build(), groups.expert)
    xs = [torch.randn(6 + 3 * r, D, generator=torch.Generator().manual_seed(40 + r), dtype=torch.float64)
          for r in range(world)]
    model(xs[rank]).square().sum().backward()
    all_reduce_gradients(dense_parameters(model), None)
    reduce_expert_gradients(model, groups)
    ref = build()
    (sum(ref(x).square().sum() for x in xs) / world).backward()
    e = 8 // groups.expert_size
    mine = slice((rank % 2) * e, (rank % 2 + 1) * e)
    experts = {id(p) for p in expert_parameters(model)}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        expected = q.grad[mine] if id(p) in experts else q.grad
        torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-12, msg=name)


CASES = {  # looked up by the spawned ranks
    "ddp": _case_ddp,
    "fsdp2": _case_fsdp2,
    "none_grads": _case_all_reduce_none_grads,
    "clip": _case_clip_both_sides,
    "groups": _case_groups,
    "expert_and_data": _case_expert_and_data_groups,
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_skips_expert_parameters(world):
    spawn_ranks(world, __name__, "ddp")


@pytest.mark.distributed
def test_fsdp2_ignores_expert_parameters():
    spawn_ranks(2, __name__, "fsdp2")


@pytest.mark.distributed
def test_all_reduce_gradients_with_missing_grads():
    spawn_ranks(2, __name__, "none_grads")


@pytest.mark.distributed
def test_clipping_over_ranks_holds_on_both_sides_of_the_global_norm():
    spawn_ranks(2, __name__, "clip")


@pytest.mark.distributed
def test_reductions_and_clipping_use_the_group_they_are_given():
    spawn_ranks(2, __name__, "groups")


@pytest.mark.distributed
def test_expert_gradients_are_those_of_the_mean_loss_over_expert_and_data_groups():
    spawn_ranks(4, __name__, "expert_and_data")
