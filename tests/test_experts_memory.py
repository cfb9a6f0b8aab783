"""The memory measure of the benchmarks (``moeflow.bench.memory``) and what the MoE layer saves
for backward with the lean experts and with expert recompute (``bench.activation``)."""

from __future__ import annotations

import pytest
import torch

from moeflow import ExpertsConfig
from bench.activation import measure, measure_stack, saved_bytes
from moeflow.bench.memory import LiveTensorBytes, peak_memory_bytes
from moeflow.parallel import expert_parallel

from helpers import seeded_layer, spawn_ranks


@pytest.mark.unit
def test_live_tensor_bytes_counts_new_storages_until_freed():
    before = torch.randn(1000)  # existed before: never counted, nor are its views
    n = 1 << 16

    def call() -> None:
        a = torch.empty(n)  # 256 KiB
        b = torch.ones(2 * n)  # 512 KiB
        _ = before.view(10, 100).t()
        a.add_(1)  # in place: no new memory
        del a
        c = b * 2  # 512 KiB beside b, a gone: the peak, 1 MiB (a + b was 768 KiB)
        del b, c

    with LiveTensorBytes() as mode:
        call()
    assert mode.peak == 4 * 4 * n
    assert peak_memory_bytes(call, torch.device("cpu")) == 4 * 4 * n


@pytest.mark.unit
def test_saved_bytes_sees_what_autograd_keeps():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)

    def fwd() -> None:
        h = x @ w  # saves x (excluded) and w (excluded)
        (h.tanh() * 2).sum()  # tanh saves its output: 32*64 floats

    assert saved_bytes(fwd, [w, x]) == 32 * 64 * 4


@pytest.mark.reference
def test_layer_saves_less_with_lean_experts_and_least_with_recompute():
    res = measure(256, 32, 64, 4, 2, repeats=1)
    saved = {name: r["saved_mb"] for name, r in res.items()}
    peak = {name: r["peak_mb"] for name, r in res.items()}
    # plain autograd saves x, h (gate+up), silu(gate) and a; lean saves x and h; recompute x only
    assert saved["recompute"] < 0.5 * saved["moeflow"] < 0.5 * saved["autograd"]
    assert peak["moeflow"] < peak["autograd"]
    # at this size recompute runs one expert chunk: no lower than the default's peak, higher by
    # at most what it holds by design (its copy of the rows and dW_in allocated before the chunks)
    rows_mb, w_in_mb = 256 * 2 * 32 * 4 / 2**20, 4 * 32 * 2 * 64 * 4 / 2**20
    assert peak["recompute"] <= peak["moeflow"] + rows_mb + w_in_mb


@pytest.mark.reference
def test_stack_of_layers_with_recompute_saves_per_layer():
    """Three layers: recompute saves about x per layer instead of x and h (h = 4x here: H = 2D,
    gated), and the fwd+bwd peak of the stack is lower with it."""
    one = measure_stack(256, 32, 64, 4, 2, layers=1, repeats=1)
    three = measure_stack(256, 32, 64, 4, 2, layers=3, repeats=1)
    for name in ("moeflow", "recompute"):
        assert three[name]["saved_mb"] > 2.5 * one[name]["saved_mb"]  # adds up over layers
    assert three["recompute"]["saved_mb"] < 0.5 * three["moeflow"]["saved_mb"]
    assert three["recompute"]["peak_mb"] < three["moeflow"]["peak_mb"]
    with pytest.raises(ValueError, match="layers"):
        measure_stack(64, 8, 8, 2, 1, layers=0)


@pytest.mark.unit
def test_live_tensor_bytes_counts_no_memory_for_a_zero_tensor():
    with LiveTensorBytes() as mode:
        z = torch._efficientzerotensor((256, 256))
        torch.ones(16).add_(torch.zeros(()).expand(16))
        del z
    assert mode.peak == 16 * 4 + 4  # the ones and the 0-dim zero, nothing for the zero tensor


@pytest.mark.reference
def test_a_later_micro_batch_adds_into_grad_and_peaks_lower():
    """``accumulate=True``: every ``.grad`` exists; the layer adds its expert weight gradients
    into it, so its peak is below the same layer with autograd's accumulation (``no-fusion``) by
    more than the smaller weight gradient (the weights here are larger than the activations)."""
    res = measure(64, 64, 128, 8, 1, repeats=1, accumulate=True)
    peak = {name: r["peak_mb"] for name, r in res.items()}
    w_out_mb = 8 * 128 * 64 * 4 / 2**20
    assert peak["no-fusion"] - peak["moeflow"] > w_out_mb
    assert peak["recompute"] <= peak["moeflow"]  # (a tie at this size: the default's backward needs no temporary of h's width)
    fresh = measure(64, 64, 128, 8, 1, repeats=1)
    assert "no-fusion" not in fresh and fresh["moeflow"]["peak_mb"] > peak["moeflow"] + w_out_mb


def _case_parallel_recompute(rank: int, world: int) -> None:
    """Each expert-parallel mode that runs the FFN on gathered or sliced weights (data,
    sharded, hybrid) honours ``ExpertsConfig.recompute``: it saves less for backward than the
    same mode without it (the hidden activation is recomputed, not kept)."""
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    for mode in ("data", "sharded", "hybrid:2"):
        saved = {}
        for recompute in (False, True):
            layer = expert_parallel(seeded_layer(4, 2, 0.0, "position", seed=3, hidden=32,
                                                 experts=ExpertsConfig(recompute=recompute)))
            xr = x.clone().requires_grad_(True)
            saved[recompute] = saved_bytes(lambda: layer(xr, parallel=mode), [xr, *layer.parameters()])
        assert saved[True] < 0.8 * saved[False], f"{mode} on rank {rank}: saved bytes {saved}"


CASES = {"parallel_recompute": _case_parallel_recompute}


@pytest.mark.distributed
def test_parallel_modes_honour_expert_recompute():
    spawn_ranks(2, __name__, "parallel_recompute")
