"""The expert-parallel dispatcher (``moeflow.parallel.dispatcher``, applied by ``expert_parallel``)
in every mode on 2 and 4 gloo ranks (127.0.0.1) against the single-process layer.

Each spawned run loops over many configurations so process start-up is paid once. Every rank
builds the same layer and batch, runs the single-process layer on the concatenated batch
itself, then the expert-parallel copy on its own slice, and compares outputs, input gradients,
router/shared (summed over ranks) and expert gradients (its shard), in fp64
(``helpers.check_equivalence``): the capacity modes, skewed routing, pipelining
(``overlap_degree``) and "auto", the data, sharded and hybrid modes, hidden-sharded experts,
bad configurations, and cases found in review.
"""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import moeflow
from moeflow import RouterConfig
from moeflow.parallel import expert_parallel

from helpers import check_equivalence, seeded_layer, spawn_ranks

pytestmark = pytest.mark.distributed

D, H = 8, 8


def _case_equivalence(rank: int, world: int) -> None:
    E = 8
    configs = [
        (k, cf, policy, weight_at)
        for k in (1, 2)
        for cf in (1.0, 0.0, -0.8)
        for policy in (("position", "score", "bpr") if cf != 0 else ("position",))
        for weight_at in ("combine", "dispatch")
    ]
    for i, (k, cf, policy, weight_at) in enumerate(configs):
        # uneven batches, one rank empty
        tokens = [7 + 5 * r for r in range(world)]
        tokens[1] = 0
        layer = seeded_layer(E, k, cf, policy, weight_at, seed=100 + i, num_shared_experts=1)
        check_equivalence(rank, world, layer, tokens, seed=100 + i, what=f"k={k} cf={cf} {policy} {weight_at}")


def _case_skewed(rank: int, world: int) -> None:
    """Every token picks expert 0 first (router bias): one rank receives everything."""
    for cf in (1.0, 0.0):
        router = RouterConfig(load_balance_coef=0.0, bias=True)
        layer = seeded_layer(8, 2, cf, "position", "combine", seed=7, router=router)
        with torch.no_grad():
            layer.router.linear.bias.zero_()
            layer.router.linear.bias[0] = 50.0
        check_equivalence(rank, world, layer, [12] * world, seed=7, what=f"skewed cf={cf}")


def _case_bad_config(rank: int, world: int) -> None:
    # E not divisible by W: every rank raises
    layer = seeded_layer(world * 2 + 1, 1, 1.0, "position", "combine", seed=3)
    with pytest.raises(ValueError, match="divisible"):
        expert_parallel(layer)
    # expert counts that differ between ranks: every rank raises (no hang)
    layer = seeded_layer(world * (2 if rank == 0 else 1), 1, 1.0, "position", "combine", seed=3)
    with pytest.raises(ValueError, match="differ between ranks"):
        expert_parallel(layer)
    # a group that does not contain this rank
    others = dist.new_group([r for r in range(world) if r != 0])
    if rank == 0:
        with pytest.raises(ValueError, match="not a member"):
            expert_parallel(seeded_layer(world * 2, 1, 1.0, "position", "combine", seed=3), group=others)
    # a model without MoE layers
    with pytest.raises(ValueError, match="no moeflow.MoE"):
        expert_parallel(torch.nn.Linear(2, 2))
    # per-call arguments that differ between ranks: every rank raises, naming the argument and
    # every rank's value, before any row moves; the group stays usable afterwards
    ep = expert_parallel(seeded_layer(world * 2, 2, 1.0, "position", "combine", seed=4))
    x = torch.randn(5 + rank, D, dtype=torch.float64)
    last = world - 1
    for kw, needle in (
        (dict(top_k=2 if rank != last else 1), f"top_k: rank 0 2, .*rank {last} 1"),
        (dict(capacity_factor=1.0 if rank != last else 0.0), f"capacity_factor: rank 0 1.0, .*rank {last} 0.0"),
        (dict(parallel="expert" if rank != last else "data"), f"parallel: rank 0 'expert', .*rank {last} 'data'"),
        (dict(overlap_degree=1 if rank != last else 2), f"overlap_degree: rank 0 1, .*rank {last} 2"),
    ):
        with pytest.raises(ValueError, match=needle):
            ep(x, **kw)
    ep(x).sum().backward()


def _case_pipelined(rank: int, world: int) -> None:
    """overlap_degree > 1 (chunked, asynchronous exchange) and "auto" equal the single process."""
    configs = [(k, cf, policy, weight_at) for k, cf, policy, weight_at in
               [(2, 1.0, "position", "combine"), (1, 0.5, "bpr", "dispatch"), (2, 0.0, "position", "combine"),
                (2, -0.8, "score", "combine")]]
    for i, (k, cf, policy, weight_at) in enumerate(configs):
        for degree in (2, 3, 5):
            tokens = [9 + 4 * r for r in range(world)]
            tokens[-1] = 0 if i == 1 else tokens[-1]  # an empty rank
            layer = seeded_layer(8, k, cf, policy, weight_at, seed=300 + i, num_shared_experts=1)
            check_equivalence(rank, world, layer, tokens, seed=300 + i, overlap_degree=degree,
                               what=f"degree={degree} k={k} cf={cf} {policy} {weight_at}")
    _pipelined_slot_chunks(rank, world)
    # "auto": tries expert/1, 2, 4, data and sharded on the first calls, then keeps one; every call is exact
    layer = seeded_layer(8, 2, 1.0, "position", "combine", seed=400)
    ep = expert_parallel(copy.deepcopy(layer))
    gen = torch.Generator().manual_seed(401)
    xs = [torch.randn(6, D, generator=gen, dtype=torch.float64) for _ in range(world)]
    ref = layer(torch.cat(xs))[rank * 6 : (rank + 1) * 6]
    x = xs[rank].clone().requires_grad_(True)
    calls = 0
    n_cand = len(ep.dispatcher.candidates(ep.experts, "auto", "auto"))
    assert n_cand == 5 + (2 if world == 4 else 1)  # expert/1,2,4, data, sharded, hybrid:2 (and :4)
    while not ep.dispatcher.tuner.choices:  # every rank decides on the same call (reduced times)
        y = ep(x, overlap_degree="auto", parallel="auto")
        torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
        y.square().sum().backward()  # trials time the backward too
        calls += 1
        # each candidate: 1 warm-up + 3 to 12 trials (these calls are short); decided a call later
        assert calls <= n_cand * 13 + 1, calls
    assert calls >= n_cand * 4 + 1
    choices = ep.dispatcher.tuner.choices
    key = (6 * world, 2, 1.0, "auto", "auto")
    assert list(choices) == [key] and choices[key] in ep.dispatcher.candidates(ep.experts, "auto", "auto")
    agreed = [None] * world
    dist.all_gather_object(agreed, choices)
    assert all(c == choices for c in agreed)
    # a fresh layer given the recorded settings runs the choice from its first call, untimed
    from moeflow.parallel import fix_tuned_settings, tuned_settings

    fresh = expert_parallel(copy.deepcopy(layer))
    fix_tuned_settings(fresh, tuned_settings(ep))
    mode, degree = choices[key]
    y = fresh(x, overlap_degree="auto", parallel="auto")
    assert not fresh.dispatcher.tuner._pending and fresh.dispatcher.tuner.choices == choices
    assert torch.equal(y, fresh(x, overlap_degree=degree, parallel=mode))
    with pytest.raises(ValueError, match="one entry per MoE layer"):
        fix_tuned_settings(fresh, [])


def _pipelined_slot_chunks(rank: int, world: int) -> None:
    """The slot chunks (``strategies.pipeline``): 4 slots per rank, so degree 3 cuts chunks of
    1, 1 and 2 slots (uneven) and degree 4 one slot each; experts 0-3 (all of rank 0's: it
    receives nothing) and 5 (so some chunk of rank 1 is empty) are never chosen; dropless,
    capacity drops (by score) and a cap; biased experts (their biases sliced with the weights).
    Outputs, input/expert/dense gradients equal the single process. A module the pipeline
    cannot slice (``ModuleExperts``) runs whole per chunk, with degree 1's results. The
    pipelined call reads the host once (the split sizes) and boolean-indexes nothing."""
    E = 4 * world
    router = RouterConfig(load_balance_coef=0.0, bias=True)
    for i, (k, cf, policy, bias) in enumerate([(2, 0.0, "position", False), (2, 0.5, "score", True),
                                               (1, -0.8, "position", False)]):
        layer = seeded_layer(E, k, cf, policy, "combine", seed=700 + i, router=router,
                             experts=moeflow.ExpertsConfig(bias=bias))
        with torch.no_grad():
            layer.router.linear.bias.zero_()
            layer.router.linear.bias[[0, 1, 2, 3, 5]] = -50.0
        tokens = [7 + 3 * r for r in range(world)]
        for degree in (2, 3, 4):
            check_equivalence(rank, world, layer, tokens, seed=700 + i, overlap_degree=degree,
                               what=f"slot chunks degree={degree} k={k} cf={cf} {policy} bias={bias}")
    # one expert per rank: nothing to cut along the slots, so the tokens are cut (a rank without
    # tokens too), the chunked FFN and the biased experts' path (whole weights per chunk)
    for i, (k, cf, policy, bias) in enumerate([(2, 0.0, "position", False), (1, 0.5, "score", True)]):
        layer = seeded_layer(world, k, cf, policy, "combine", seed=730 + i, experts=moeflow.ExpertsConfig(bias=bias))
        tokens = [7 + 3 * r for r in range(world)]
        tokens[-1] = 0
        for degree in (2, 3):
            check_equivalence(rank, world, layer, tokens, seed=730 + i, overlap_degree=degree,
                               what=f"token chunks degree={degree} k={k} cf={cf} {policy} bias={bias}")
    # recompute: not the chunked FFN (eligible says why), the weights split per chunk instead
    layer = seeded_layer(E, 2, 1.0, "position", "combine", seed=710, experts=moeflow.ExpertsConfig(recompute=True))
    check_equivalence(rank, world, layer, [6] * world, seed=710, overlap_degree=3, what="slot chunks recompute")
    _chunked_ffn_paths(rank, world, E)
    torch.manual_seed(5)
    mods = [torch.nn.Sequential(torch.nn.Linear(D, 4, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(4, D, dtype=torch.float64)) for _ in range(E)]
    ep = expert_parallel(moeflow.MoE(dim=D, hidden=4, num_experts=E, top_k=2, capacity_factor=0, dtype=torch.float64,
                                     router=RouterConfig(load_balance_coef=0.0), experts_module=moeflow.ModuleExperts(mods)))
    x = torch.randn(5 + rank, D, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    g = torch.randn_like(x)
    results = []
    for degree in (1, 2, 4):
        xd = x.clone().requires_grad_(True)
        y = ep(xd, overlap_degree=degree)
        grads = torch.autograd.grad(y, [xd, *ep.experts.parameters()], g)
        results.append((y, grads))
    for y, grads in results[1:]:
        torch.testing.assert_close(y, results[0][0], rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, results[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ep = expert_parallel(seeded_layer(E, 2, 0.0, "position", "combine", seed=2))
    by_tokens = expert_parallel(seeded_layer(world, 1, 0.0, "position", "combine", seed=3))  # one slot per rank
    for layer in (ep, by_tokens):
        for where, expected in (("strategies/pipeline.py", ["tolist"]), ("strategies/chunk_ffn.py", []),
                                ("exchange/chunked.py", [])):
            with _HostReadsIn(where) as reads:
                x = torch.randn(6, D, dtype=torch.float64, requires_grad=True)
                layer(x, overlap_degree=2).sum().backward()
            assert [r.split()[0] for r in reads.seen] == expected, (where, reads.seen)


def _chunked_ffn_paths(rank: int, world: int, E: int) -> None:
    """``ChunkedFFN`` (the weight gradients as one GEMM over every chunk's rows) on both grouped
    backends (fp64: ``loop``, fp32: ``grouped_mm``) against degree 1 on the same layer, with
    ``.grad`` absent and then accumulated into (the fused add of ``moeflow.experts.weight_grads``)
    over two calls; and frozen experts (no weight gradient: ``dh`` over ``h``)."""
    from moeflow.parallel.strategies.chunk_ffn import ChunkedFFN

    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        layer = seeded_layer(E, 2, 0.0, "position", "combine", seed=720).to(dtype)
        gen = torch.Generator().manual_seed(721 + rank)
        xs = [torch.randn(5 + rank, D, generator=gen, dtype=dtype) for _ in range(2)]
        gs = [torch.randn_like(x) for x in xs]
        out = {}
        for degree in (1, 4):
            ep = expert_parallel(copy.deepcopy(layer))
            assert ChunkedFFN.eligible(ep.experts, xs[0])
            ys, dxs = [], []
            for x, g in zip(xs, gs):  # two calls, their expert gradients accumulated in .grad
                x = x.clone().requires_grad_(True)
                y = ep(x, overlap_degree=degree)
                (y * g).sum().backward()
                ys.append(y.detach())
                dxs.append(x.grad)
            out[degree] = (ys, dxs, [p.grad.clone() for p in ep.experts.parameters()])
        for a, b in zip(sum(out[4], []), sum(out[1], [])):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    frozen = expert_parallel(seeded_layer(E, 2, 0.0, "position", "combine", seed=722))
    frozen.experts.requires_grad_(False)
    x = torch.randn(4 + rank, D, dtype=torch.float64, requires_grad=True)
    y4 = frozen(x, overlap_degree=4)
    (dx4,) = torch.autograd.grad(y4.square().sum(), x)
    y1 = frozen(x, overlap_degree=1)
    (dx1,) = torch.autograd.grad(y1.square().sum(), x)
    torch.testing.assert_close((y4, dx4), (y1, dx1), rtol=1e-12, atol=1e-12)


class _HostReadsIn(TorchFunctionMode):
    """Records the tensor calls that read values on the host (``bincount``, ``nonzero``, a
    boolean index, ``item``, ...) made directly by code in a file whose path ends with ``where``."""

    NAMES = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                       "bincount", "unique", "masked_select", "repeat_interleave"})

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.seen = where, []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        boolean_index = name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in (args[1:] if len(args) > 1 else ()))
        if (name in self.NAMES or boolean_index) and sys._getframe(1).f_code.co_filename.endswith(self.where):
            self.seen.append(f"{name} at line {sys._getframe(1).f_lineno}")
        return func(*args, **(kwargs or {}))


def _case_data_parallel(rank: int, world: int) -> None:
    """parallel="data" (weights gathered, tokens stay) on the same shards equals the single
    process: outputs, input/expert/dense gradients, in every capacity mode; bad uses raise."""
    configs = [(2, 1.0, "position", "combine"), (1, 0.5, "bpr", "dispatch"), (2, 0.0, "position", "combine"),
               (2, -0.8, "score", "combine")]
    for i, (k, cf, policy, weight_at) in enumerate(configs):
        tokens = [9 + 4 * r for r in range(world)]
        tokens[0] = 0 if i == 2 else tokens[0]
        layer = seeded_layer(8, k, cf, policy, weight_at, seed=500 + i, num_shared_experts=1,
                       experts=moeflow.ExpertsConfig(activation="gelu", bias=True))
        check_equivalence(rank, world, layer, tokens, seed=500 + i, parallel="data",
                           what=f"data k={k} cf={cf} {policy} {weight_at}")
    # the data mode reads nothing on the host itself (a host read is a GPU stall): counts by a
    # scatter-add, not torch.bincount or a boolean index
    ep = expert_parallel(seeded_layer(8, 2, 0.0, "position", "combine", seed=2))
    with _HostReadsIn("strategies/data.py") as reads:
        ep(torch.randn(6, D, dtype=torch.float64), parallel="data")
    assert reads.seen == [], reads.seen
    ep = expert_parallel(seeded_layer(8, 2, 1.0, "position", "combine", seed=1))
    for kw, needle in ((dict(parallel="data", overlap_degree=2), "overlap_degree=2"),
                       (dict(parallel="model"), "parallel must be one of")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            ep(torch.randn(4, D, dtype=torch.float64), **kw)


def _case_sharded(rank: int, world: int) -> None:
    """parallel="sharded" (every rank a slice of every expert's hidden units) on the same shards
    equals the single process, gated and not, with biases, in every capacity mode; bad uses raise."""
    configs = [(2, 1.0, "position", "combine", "swiglu", False), (1, 0.5, "bpr", "dispatch", "gelu", True),
               (2, 0.0, "position", "combine", "geglu", True), (2, -0.8, "score", "combine", "relu", False)]
    for i, (k, cf, policy, weight_at, act, bias) in enumerate(configs):
        tokens = [9 + 4 * r for r in range(world)]
        tokens[0] = 0 if i == 2 else tokens[0]
        layer = seeded_layer(8, k, cf, policy, weight_at, seed=700 + i, num_shared_experts=1,
                       experts=moeflow.ExpertsConfig(activation=act, bias=bias))
        check_equivalence(rank, world, layer, tokens, seed=700 + i, parallel="sharded",
                           what=f"sharded k={k} cf={cf} {policy} {weight_at} {act} bias={bias}")
    # the tuner may pick it: "auto" gives the same result
    layer = seeded_layer(8, 2, 0.0, "position", "combine", seed=710)
    check_equivalence(rank, world, layer, [12] * world, seed=710, parallel="auto", what="auto with sharded")
    torch.manual_seed(0)
    odd = expert_parallel(moeflow.MoE(dim=D, hidden=6 if world == 4 else 5, num_experts=8, top_k=2, dtype=torch.float64))
    for kw, needle in ((dict(parallel="sharded"), "must be divisible"),
                       (dict(parallel="sharded", overlap_degree=2), "overlap_degree=2")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            odd(torch.randn(4, D, dtype=torch.float64), **kw)


def _case_hidden_shards(rank: int, world: int) -> None:
    """expert_parallel(hidden_shards=n): E*n hidden slices spread over the ranks (E < W works);
    equal to the single process in every capacity mode and parallel setting."""
    from moeflow.experts import GroupedExperts

    cases = [(2, world // 2 if world > 2 else 2), (4, 2), (8, 2)]  # (E, n); E=2 on 4 ranks needs n=2
    configs = [(2, 1.0, "position", "combine", "swiglu"), (1, 0.0, "position", "dispatch", "gelu"),
               (2, 1.25, "score", "combine", "relu"), (2, -0.8, "position", "combine", "geglu")]
    i = 0
    for E, n in cases:
        if (E * n) % world:
            continue
        for k, cf, policy, weight_at, act in configs:
            for call in ({}, {"parallel": "data"}, {"overlap_degree": 2}, {"parallel": "sharded"}):
                tokens = [7 + 3 * r for r in range(world)]
                tokens[-1] = 0 if i % 3 == 0 else tokens[-1]
                layer = seeded_layer(E, min(k, E), cf, policy, weight_at, seed=800 + i,
                               experts=moeflow.ExpertsConfig(activation=act), num_shared_experts=1)
                what = f"E={E} n={n} k={k} cf={cf} {policy} {weight_at} {act} {call}"
                e = E * n // world

                def sliced(name, t, E=E, n=n, e=e, cfg=layer.experts.config):  # type: ignore[no-untyped-def]
                    # the reference tensor in the hidden-sliced layout, this rank's part
                    full = GroupedExperts(num_experts=E, dim=D, hidden=H, config=cfg, dtype=torch.float64)
                    with torch.no_grad():
                        getattr(full, name).copy_(t)
                    return getattr(full.hidden_slices(n).shard(rank * e, e), name)

                check_equivalence(rank, world, layer, tokens, seed=900 + i, what=what,
                                   shard=lambda m, n=n: expert_parallel(m, hidden_shards=n), expert_view=sliced, **call)
                i += 1
    for bad, n, needle in ((dict(num_experts=3, hidden=9), 3, "group size"), (dict(num_experts=4, hidden=7), 2, "hidden size"),
                           (dict(num_experts=4, hidden=8, experts=moeflow.ExpertsConfig(bias=True)), 2, "without biases")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            torch.manual_seed(0)
            expert_parallel(moeflow.MoE(dim=D, top_k=1, dtype=torch.float64, **bad), hidden_shards=n)


def _case_hybrid(rank: int, world: int) -> None:
    """parallel="hybrid:r" (per call, on the stored expert shards: every expert split into r
    hidden slices on r ranks) equals the single process, gated and not, in every capacity mode."""
    configs = [(2, 1.0, "position", "combine", "swiglu"), (1, 0.5, "bpr", "dispatch", "gelu"),
               (2, 0.0, "position", "combine", "geglu"), (2, -0.8, "score", "combine", "relu")]
    for r in (2, 4) if world == 4 else (2,):
        for i, (k, cf, policy, weight_at, act) in enumerate(configs):
            tokens = [9 + 4 * q for q in range(world)]
            tokens[0] = 0 if i == 2 else tokens[0]
            layer = seeded_layer(8, k, cf, policy, weight_at, seed=950 + i, num_shared_experts=1,
                           experts=moeflow.ExpertsConfig(activation=act))
            check_equivalence(rank, world, layer, tokens, seed=950 + i, parallel=f"hybrid:{r}",
                               what=f"hybrid:{r} k={k} cf={cf} {policy} {weight_at} {act}")
    ep = expert_parallel(seeded_layer(8, 2, 1.0, "position", "combine", seed=1))
    for kw, needle in ((dict(parallel="hybrid:3"), "dividing the hidden size"),
                       (dict(parallel="hybrid:1"), "'hybrid:r'"),
                       (dict(parallel="hybrid:2", overlap_degree=2), "overlap_degree=2")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            ep(torch.randn(4, D, dtype=torch.float64), **kw)


def _case_review_regressions(rank: int, world: int) -> None:
    """Cases a review found: a rank whose experts get nothing, all tokens dropped, ModuleExperts
    with an idle rank, applying expert_parallel twice, a custom experts module with shard()."""
    # k=1, every token to expert 0: ranks > 0 receive nothing (cf > 0 and dropless)
    for cf in (1.0, 0.0):
        router = RouterConfig(load_balance_coef=0.0, bias=True)
        layer = seeded_layer(world * 2, 1, cf, "position", "combine", seed=21, router=router)
        with torch.no_grad():
            layer.router.linear.bias.zero_()
            layer.router.linear.bias[0] = 50.0
        check_equivalence(rank, world, layer, [6] * world, seed=21, what=f"nothing received cf={cf}")
    # every assignment dropped on some ranks (tiny capacity), fixed and capped
    for cf in (1e-6, -1e-6):
        layer = seeded_layer(world * 2, 1, cf, "position", "combine", seed=22)
        check_equivalence(rank, world, layer, [5] * world, seed=22, what=f"all dropped cf={cf}")
    # ModuleExperts: a rank with idle experts still joins the backward exchange
    torch.manual_seed(3)
    mods = [torch.nn.Sequential(torch.nn.Linear(D, 4, dtype=torch.float64), torch.nn.Tanh(), torch.nn.Linear(4, D, dtype=torch.float64))
            for _ in range(world * 2)]
    layer = moeflow.MoE(dim=D, hidden=4, num_experts=world * 2, top_k=1, capacity_factor=0, dtype=torch.float64,
                        router=RouterConfig(load_balance_coef=0.0, bias=True), experts_module=moeflow.ModuleExperts(mods)).eval()
    with torch.no_grad():
        layer.router.linear.bias[0] = 50.0
    ep = expert_parallel(layer)
    x = torch.randn(4, D, dtype=torch.float64, requires_grad=True)
    ep(x).sum().backward()
    assert x.grad is not None
    # twice: every rank raises the same error
    with pytest.raises(ValueError, match="already applied"):
        expert_parallel(ep)
    # a custom experts module that knows how to shard itself
    class Halves(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.num_experts = n
            self.scale = torch.nn.Parameter(torch.arange(1.0, n + 1, dtype=torch.float64))

        def shard(self, start: int, count: int) -> "Halves":
            part = Halves(count)
            part.scale.data.copy_(self.scale.data[start : start + count])
            return part

        def forward(self, expert_in, counts_E):
            expert_E = torch.repeat_interleave(torch.arange(self.num_experts), counts_E)
            return expert_in * self.scale[expert_E].unsqueeze(1)

    custom = moeflow.MoE(dim=D, hidden=4, num_experts=world * 2, top_k=1, capacity_factor=0, dtype=torch.float64,
                         experts_module=Halves(world * 2))
    expert_parallel(custom)
    assert custom.experts.scale.tolist() == [2.0 * rank + 1, 2.0 * rank + 2]


CASES = {  # looked up by the spawned ranks
    "equivalence": _case_equivalence,
    "skewed": _case_skewed,
    "bad_config": _case_bad_config,
    "pipelined": _case_pipelined,
    "data_parallel": _case_data_parallel,
    "sharded": _case_sharded,
    "hidden_shards": _case_hidden_shards,
    "hybrid": _case_hybrid,
    "review": _case_review_regressions,
}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["equivalence", "pipelined", "data_parallel", "sharded", "hybrid", "hidden_shards"])
def test_parallel_settings_match_single_process(case, world):
    """Each case runs its settings (expert-parallel capacity modes, pipelining, the data,
    sharded and hybrid modes, hidden-sharded storage) against the single-process layer."""
    spawn_ranks(world, __name__, case)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_skewed_routing(world):
    spawn_ranks(world, __name__, "skewed")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_bad_configuration_raises_everywhere(world):
    spawn_ranks(world, __name__, "bad_config")


@pytest.mark.parametrize("world", [2, 4])
def test_review_regressions(world):
    spawn_ranks(world, __name__, "review")

