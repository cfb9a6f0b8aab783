"""Tier 3: expert parallelism on 2 and 4 gloo ranks (127.0.0.1) against the single-process layer.

Each spawned run loops over many configurations so process start-up is paid once. Every rank
builds the same layer and batch, runs the single-process layer on the concatenated batch
itself, then the expert-parallel copy on its own slice, and compares outputs, input gradients,
router/shared (summed over ranks) and expert gradients (its shard), in fp64.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moeflow
from moeflow import DispatchConfig, RouterConfig
from moeflow.parallel import all_reduce_gradients, dense_parameters, expert_parallel

TIMEOUT_S = 240
D, H = 8, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, case: str, errors) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        CASES[case](rank, world)
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def run_ranks(world: int, case: str) -> None:
    """Run ``CASES[case]`` on ``world`` gloo ranks; fail (never hang) after TIMEOUT_S."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    proc = mp.start_processes(_entry, args=(world, _free_port(), case, errors), nprocs=world, join=False, start_method="spawn")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    try:
        while not proc.join(timeout=2):
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"{case} on {world} ranks did not finish in {TIMEOUT_S}s")
    except Exception as err:
        for p in proc.processes:
            if p.is_alive():
                p.kill()
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        raise AssertionError(f"{case} failed on {world} ranks: {err}\n" + "\n".join(msgs)) from None


def _layer(E: int, k: int, cf: float, policy: str, weight_at: str, seed: int, **fields) -> moeflow.MoE:
    torch.manual_seed(seed)
    layer = moeflow.MoE(
        dim=D, hidden=H, num_experts=E, top_k=k, capacity_factor=cf,
        router=fields.pop("router", RouterConfig(load_balance_coef=0.0)),
        dispatch=DispatchConfig(drop_policy=policy, weight_at=weight_at),
        dtype=torch.float64, **fields,
    ).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return layer


def _check_equivalence(rank: int, world: int, layer: moeflow.MoE, tokens: list[int], seed: int, what: str) -> None:
    gen = torch.Generator().manual_seed(seed + 2)
    xs = [torch.randn(t, D, generator=gen, dtype=torch.float64) for t in tokens]
    gs = [torch.randn(t, D, generator=gen, dtype=torch.float64) for t in tokens]
    start = sum(tokens[:rank])
    sl = slice(start, start + tokens[rank])

    ref = copy.deepcopy(layer)
    x_all = torch.cat(xs).requires_grad_(True)
    y_all = ref(x_all)
    (y_all * torch.cat(gs)).sum().backward()

    ep = expert_parallel(copy.deepcopy(layer))
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x)
    (y * gs[rank]).sum().backward()

    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, y_all[sl].detach(), **tol, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(x.grad, x_all.grad[sl], **tol, msg=lambda m: f"{what} input grad: {m}")
    e = layer.config.num_experts // world
    for name, p in ep.experts.named_parameters():
        expected = dict(ref.experts.named_parameters())[name].grad[rank * e : (rank + 1) * e]
        torch.testing.assert_close(p.grad, expected, **tol, msg=lambda m: f"{what} expert {name} grad: {m}")
    # dense parameters: the group's summed gradient equals the single-process gradient
    all_reduce_gradients(dense_parameters(ep), None, average=False)
    ref_dense = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        if getattr(p, "moeflow_expert", False):
            continue
        torch.testing.assert_close(p.grad, ref_dense[name].grad, **tol, msg=lambda m: f"{what} {name} grad: {m}")
    # one SGD step gives identical parameters (experts: the shard of the single-process step)
    for model in (ref, ep):
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    for name, p in ep.named_parameters():
        expected = ref_dense[name]
        if getattr(p, "moeflow_expert", False):
            expected = expected[rank * e : (rank + 1) * e]
        torch.testing.assert_close(p, expected, **tol, msg=lambda m: f"{what} {name} after step: {m}")


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
        layer = _layer(E, k, cf, policy, weight_at, seed=100 + i, num_shared_experts=1)
        _check_equivalence(rank, world, layer, tokens, seed=100 + i, what=f"k={k} cf={cf} {policy} {weight_at}")


def _case_skewed(rank: int, world: int) -> None:
    """Every token picks expert 0 first (router bias): one rank receives everything."""
    for cf in (1.0, 0.0):
        router = RouterConfig(load_balance_coef=0.0, bias=True)
        layer = _layer(8, 2, cf, "position", "combine", seed=7, router=router)
        with torch.no_grad():
            layer.router.linear.bias.zero_()
            layer.router.linear.bias[0] = 50.0
        _check_equivalence(rank, world, layer, [12] * world, seed=7, what=f"skewed cf={cf}")


def _case_bad_config(rank: int, world: int) -> None:
    # E not divisible by W: every rank raises
    layer = _layer(world * 2 + 1, 1, 1.0, "position", "combine", seed=3)
    with pytest.raises(ValueError, match="divisible"):
        expert_parallel(layer)
    # expert counts that differ between ranks: every rank raises (no hang)
    layer = _layer(world * (2 if rank == 0 else 1), 1, 1.0, "position", "combine", seed=3)
    with pytest.raises(ValueError, match="differ between ranks"):
        expert_parallel(layer)
    # a group that does not contain this rank
    others = dist.new_group([r for r in range(world) if r != 0])
    if rank == 0:
        with pytest.raises(ValueError, match="not a member"):
            expert_parallel(_layer(world * 2, 1, 1.0, "position", "combine", seed=3), group=others)
    # a model without MoE layers
    with pytest.raises(ValueError, match="no moeflow.MoE"):
        expert_parallel(torch.nn.Linear(2, 2))


CASES = {"equivalence": _case_equivalence, "skewed": _case_skewed, "bad_config": _case_bad_config}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(world):
    run_ranks(world, "equivalence")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_skewed_routing(world):
    run_ranks(world, "skewed")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_bad_configuration_raises_everywhere(world):
    run_ranks(world, "bad_config")
