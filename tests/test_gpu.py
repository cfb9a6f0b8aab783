"""What only a GPU can show: the compiled Triton kernels at full size, moeflow's defaults on
CUDA, expert parallelism and the rest of ``moeflow.parallel`` over NCCL, and the trainer on CUDA.

Every test is ``@pytest.mark.gpu`` and skipped without CUDA (CI has none); on a GPU machine
``pytest -m gpu tests`` runs them, and ``python bench/gpu_check.py`` runs that among its stages.
The kernels here must run compiled: with CUDA present ``conftest.py`` leaves the Triton
interpreter off, and the first test fails if it is on.

The NCCL tests run on as many ranks as there are GPUs (at most 2; one GPU gives a 1-rank group,
which still sends every tensor through NCCL: a CPU tensor in a collective fails there) and
compare with the single process, in fp64 like the gloo tests, plus a bf16 case on the fast path.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeflow
from moeflow.experts.ffn import grouped_ffn
from moeflow.kernels import grouped_mm_loop, resolve_grouped_mm_backend

from helpers import assert_close_rel, check_equivalence, needs_cuda, random_counts, seeded_layer, spawn_ranks

pytestmark = [pytest.mark.gpu, needs_cuda]

REPO = Path(__file__).resolve().parents[1]

# relative tolerance of a kernel vs the reference at the same precision
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def assert_kernel_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``assert_close_rel`` at ``dtype``'s tolerance, relative to the largest reference magnitude."""
    assert_close_rel(actual, expected, TOL[dtype], what, floor=1e-6, same_dtype=False)


def _nccl_world() -> int:
    return max(1, min(2, torch.cuda.device_count()))


# ------------------------------------------------------------------------------------------
# compiled kernels


@pytest.mark.reference
def test_triton_kernels_run_compiled_not_interpreted():
    """A GPU run must test the compiled kernels: the interpreter is off and every kernel of
    ``moeflow.kernels.triton`` is a compiled ``JITFunction``, and one of them runs on CUDA."""
    pytest.importorskip("triton")
    from moeflow.kernels import triton as mt
    from moeflow.kernels.triton import grouped_gemm_kernels, permute, routing, slots

    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "TRITON_INTERPRET is set in a GPU test run"
    assert not mt.interpreter_active()
    kinds = {type(v).__name__ for m in (permute, slots, routing, grouped_gemm_kernels) for v in vars(m).values()
             if type(v).__name__ in ("JITFunction", "InterpretedFunction")}
    assert kinds == {"JITFunction"}, kinds
    x, w = torch.randn(10, 32, device="cuda"), torch.randn(2, 32, 16, device="cuda")
    offs = torch.tensor([4, 10], device="cuda")
    torch.testing.assert_close(mt.grouped_mm_triton(x, w, offs), grouped_mm_loop(x, w, offs), rtol=1e-5, atol=1e-4)


@pytest.mark.reference
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_ffn_full_size(activation):
    pytest.importorskip("triton")
    from moeflow.kernels import triton as mt

    gen = torch.Generator(device="cuda").manual_seed(0)
    E, D, H, R = 8, 1024, 1408, 8191
    gated = activation == "swiglu"
    counts = torch.tensor([2000, 0, 1, 3000, 190, 1000, 2000, 0], device="cuda")
    counts[0] += R - int(counts.sum())
    kw = dict(device="cuda", generator=gen)
    x = torch.randn(R, D, **kw).bfloat16().requires_grad_(True)
    w_in = (torch.randn(E, D, 2 * H if gated else H, **kw) * D**-0.5).bfloat16().requires_grad_(True)
    w_out = (torch.randn(E, H, D, **kw) * H**-0.5).bfloat16().requires_grad_(True)
    y = mt.grouped_ffn_triton(x, counts, w_in, w_out, activation=activation)
    y_ref = grouped_ffn(x, counts, w_in, w_out, activation=activation, backend="loop")
    assert_kernel_close(y, y_ref, torch.bfloat16, "y")
    g = torch.randn(R, D, **kw).bfloat16()
    for a, b in zip(torch.autograd.grad(y, (x, w_in, w_out), g), torch.autograd.grad(y_ref, (x, w_in, w_out), g)):
        assert_kernel_close(a, b, torch.bfloat16, "grad")


@pytest.mark.reference
@pytest.mark.parametrize("E,empty", [(64, 40), (256, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_ffn_odd_sizes_many_empty_experts(E, empty, dtype, activation):
    """D=1000, H=1400 (not multiples of any tile: K, N and row tails in every GEMM), most
    experts empty, transposed (Hugging Face [E, F, D] / [E, D, H]) weight views, bf16 and fp16;
    plus the grouped GEMM alone and offsets the kernels must clamp (offs_E[-1] != R)."""
    pytest.importorskip("triton")
    from moeflow.kernels import triton as mt

    gen = torch.Generator(device="cuda").manual_seed(E)
    D, H, R = 1000, 1400, 3001
    gated = activation == "swiglu"
    F = 2 * H if gated else H
    counts = random_counts(torch.Generator().manual_seed(E), E, R, empty).cuda()
    kw = dict(device="cuda", generator=gen)
    x = torch.randn(R, D, **kw).to(dtype).requires_grad_(True)
    w_in_EFD = (torch.randn(E, F, D, **kw) * D**-0.5).to(dtype).requires_grad_(True)
    w_out_EDH = (torch.randn(E, D, H, **kw) * H**-0.5).to(dtype).requires_grad_(True)
    w_in, w_out = w_in_EFD.transpose(1, 2), w_out_EDH.transpose(1, 2)  # strided views
    y = mt.grouped_ffn_triton(x, counts, w_in, w_out, activation=activation)
    y_ref = grouped_ffn(x, counts, w_in, w_out, activation=activation, backend="loop")
    assert_kernel_close(y, y_ref, dtype, "y")
    g = torch.randn(R, D, **kw).to(dtype)
    params = (x, w_in_EFD, w_out_EDH)
    got, ref = torch.autograd.grad(y, params, g), torch.autograd.grad(y_ref, params, g)
    for name, a, b in zip(("x", "w_in", "w_out"), got, ref):
        assert_kernel_close(a, b, dtype, f"grad {name}")
    assert torch.all(got[1][counts == 0] == 0) and torch.all(got[2][counts == 0] == 0)
    offs = torch.cumsum(counts, 0)
    y_mm = mt.grouped_mm_triton(x, w_in, offs)
    assert_kernel_close(y_mm, grouped_mm_loop(x, w_in, offs), dtype, "grouped_mm")
    # GPU offsets are not checked: past R they are cut at R, short of R the tail rows are zeros
    short, long_ = offs.clamp(max=R - 7), offs.clone()  # (the last experts may be empty)
    long_[-1] += 500
    y_short = torch.ops.moeflow.grouped_mm(x, w_in, short)
    assert torch.equal(y_short[R - 7 :], torch.zeros_like(y_short[R - 7 :]))
    torch.testing.assert_close(y_short[: R - 7], y_mm[: R - 7])
    torch.testing.assert_close(torch.ops.moeflow.grouped_mm(x, w_in, long_), y_mm)
    torch.cuda.synchronize()


@pytest.mark.reference
@pytest.mark.parametrize("T", [1, 16])
def test_grouped_ffn_decode_rows_full_width(T):
    """A decode step of the Qwen3-30B-A3B layer's shape (T tokens x top-8 over 128 experts,
    width 2048, expert hidden 768) in bf16, through the few-row tiles: outputs and gradients
    against the loop reference."""
    pytest.importorskip("triton")
    from moeflow.kernels import triton as mt

    E, K, D, H = 128, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(T)
    kw = dict(device="cuda", generator=gen)
    ids = torch.rand(T, E, **kw).topk(K, dim=1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    R = T * K
    x = torch.randn(R, D, **kw).to(torch.bfloat16).requires_grad_(True)
    w_in = (torch.randn(E, D, 2 * H, **kw) * D**-0.5).to(torch.bfloat16).requires_grad_(True)
    w_out = (torch.randn(E, H, D, **kw) * H**-0.5).to(torch.bfloat16).requires_grad_(True)
    y = mt.grouped_ffn_triton(x, counts, w_in, w_out, activation="swiglu")
    y_ref = grouped_ffn(x, counts, w_in, w_out, activation="swiglu", backend="loop")
    assert_close_rel(y, y_ref, 3e-2, "y", floor=1e-6, same_dtype=False)
    g = torch.randn(R, D, **kw).to(torch.bfloat16)
    params = (x, w_in, w_out)
    got, ref = torch.autograd.grad(y, params, g), torch.autograd.grad(y_ref, params, g)
    for name, a, b in zip(("x", "w_in", "w_out"), got, ref):
        assert_close_rel(a, b, 3e-2, f"grad {name}", floor=1e-6, same_dtype=False)
    with torch.no_grad():
        assert torch.equal(mt.grouped_ffn_triton(x, counts, w_in, w_out, activation="swiglu"), y.detach())
    torch.cuda.synchronize()


@pytest.mark.reference
def test_routing_slots_permute_full_size():
    pytest.importorskip("triton")
    from moeflow.kernels import triton as mt
    from moeflow.kernels.permute import permute_rows
    from moeflow.routing import select_experts

    gen = torch.Generator(device="cuda").manual_seed(0)
    T, E, K, D = 16384, 256, 8, 2048
    logits = torch.randn(T, E, device="cuda", generator=gen)
    w, ids, s = mt.fused_topk_routing(logits, top_k=K, scoring="sigmoid", normalize_topk=True)
    w_ref, ids_ref, _ = select_experts(logits, top_k=K, scoring="sigmoid", normalize_topk=True)
    # 4M sigmoid scores hold exact ties, which the two may order differently: ids must agree
    # wherever the picked scores differ
    differ = ids != ids_ref
    assert torch.equal(s.gather(1, ids)[differ], s.gather(1, ids_ref)[differ])
    assert_kernel_close(w, w_ref, torch.float32, "weights")
    pos, counts, _ = mt.assign_positions(ids, E, capacity=None, choice_major=True)
    pos_ref, counts_ref, _ = mt.assign_positions_reference(ids[:512], E, choice_major=False)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=E))
    assert torch.equal(mt.assign_positions(ids[:512], E, choice_major=False)[0], pos_ref)
    row_A = (torch.cumsum(counts, 0) - counts)[ids.reshape(-1)] + mt.assign_positions(ids, E, choice_major=False)[0]
    assign_M = torch.empty_like(row_A).scatter_(0, row_A, torch.arange(T * K, device="cuda"))
    x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
    x_MD = permute_rows(x, assign_M // K, None, row_A.view(T, K), None)
    assert torch.equal(x_MD, x[assign_M // K])


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_row_and_activation_ops_run_triton_on_cuda(dtype):
    """The layer's permute / unpermute and activation ops take their Triton kernels on CUDA and
    equal their torch references (outputs and gradients), at a realistic size."""
    pytest.importorskip("triton")
    from moeflow.kernels.activation import activate, activate_backward_, activate_backward_reference_, activate_reference
    from moeflow.kernels.permute import (gather_rows_reference, permute_rows, unpermute_rows,
                                         unpermute_rows_reference)

    gen = torch.Generator(device="cuda").manual_seed(0)
    T, K, D, E = 4096, 2, 1024, 8
    ids = torch.randint(0, E, (T * K,), device="cuda", generator=gen)
    order = torch.sort(ids, stable=True).indices  # the assignment of each expert row
    row_A = torch.empty_like(order).scatter_(0, order, torch.arange(T * K, device="cuda"))
    x = torch.randn(T, D, device="cuda", generator=gen, dtype=dtype, requires_grad=True)
    args = (order // K, None, row_A.view(T, K), None)
    got, ref = permute_rows(x, *args), gather_rows_reference(x, *args)
    assert torch.equal(got, ref)
    g = torch.randn_like(got)
    assert_kernel_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(ref, x, g)[0], dtype, "permute grad")
    y = torch.randn(T * K, D, device="cuda", generator=gen, dtype=dtype, requires_grad=True)
    w = torch.rand(T, K, device="cuda", generator=gen, dtype=dtype, requires_grad=True)
    uargs = (row_A.view(T, K), None, w, order, None)
    out, out_ref = unpermute_rows(y, *uargs), unpermute_rows_reference(y, *uargs)
    assert_kernel_close(out, out_ref, dtype, "unpermute")
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (y, w), g), torch.autograd.grad(out_ref, (y, w), g)):
        assert_kernel_close(a, b, dtype, "unpermute grad")
    h = torch.randn(T * K, 2 * 1408, device="cuda", generator=gen, dtype=dtype)
    assert_kernel_close(activate(h, "swiglu"), activate_reference(h, "swiglu"), dtype, "swiglu")
    da = torch.randn(T * K, 1408, device="cuda", generator=gen, dtype=dtype)
    a, b = h.clone(), h.clone()
    activate_backward_(a, da.clone(), "swiglu")
    activate_backward_reference_(b, da.clone(), "swiglu")
    assert_kernel_close(a, b, dtype, "swiglu backward")


# ------------------------------------------------------------------------------------------
# defaults on CUDA


@pytest.mark.reference
def test_routing_tape_records_on_the_cpu_and_replays_on_the_gpu():
    """A tape holds its calls as int64 CPU tensors whatever device the layer runs on (it is
    saved and moved between runs), and a replay on the GPU gives the recorded forward."""
    torch.manual_seed(0)
    layer = moeflow.MoE(dim=64, hidden=128, num_experts=8, top_k=2).cuda()
    x = torch.randn(32, 64, device="cuda")
    with moeflow.record_routing(layer) as tape:
        ref = layer(x)
    (ids,) = tape.calls[""]
    assert ids.device.type == "cpu" and ids.dtype == torch.int64 and ids.shape == (32, 2)
    with moeflow.replay_routing(layer, tape):
        assert torch.equal(layer(x), ref)


@pytest.mark.reference
@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
@pytest.mark.parametrize("gemm", ["bmm", "loop", "grouped_mm"])
def test_expert_weight_grads_add_into_dot_grad_on_the_gpu(gemm, recompute):
    """The second micro-batch adds the expert weights' gradients into ``.grad`` and hands autograd
    a zero tensor, which must be on the weight's device: a custom Function's backward runs without
    Python's function modes, so the CPU tests' ``meta`` default device cannot see a tensor built
    there without naming its device; on a GPU it lands on the CPU and autograd refuses it."""
    from moeflow.experts.lean import lean_ffn

    gen = torch.Generator(device="cuda").manual_seed(0)
    E, D, H = 4, 64, 64
    kw = dict(device="cuda", generator=gen)
    w_in, w_out = torch.randn(E, D, 2 * H, **kw), torch.randn(E, H, D, **kw)
    if gemm == "bmm":
        xs, offs = [torch.randn(E, 6, D, **kw) for _ in range(2)], None
    else:
        offs = torch.tensor([5, 5, 12, 20], device="cuda", dtype=torch.int32)  # expert 1 has no rows
        xs = [torch.randn(20, D, **kw) for _ in range(2)]
    grads = []
    for hook in (False, True):  # a tensor hook keeps autograd's own accumulation: the reference
        a, b = w_in.clone().requires_grad_(), w_out.clone().requires_grad_()
        if hook:
            a.register_hook(lambda g: g)
            b.register_hook(lambda g: g)
        for x in xs:
            lean_ffn(x, a, b, offs, activation="swiglu", gemm=gemm, recompute=recompute).square().sum().backward()
        grads.append((a.grad, b.grad))
    for got, want in zip(*grads):
        assert got.device == w_in.device and not got._is_zerotensor()
        assert_kernel_close(got, want, torch.float32, "dW")


@pytest.mark.reference
def test_default_experts_backend_is_the_measured_fastest_and_correct():
    """``backend="auto"`` on this GPU: torch's grouped GEMM on Hopper and later, Triton before
    (``moeflow.kernels.grouped_mm``); the default layer equals the per-expert loop."""
    major, _ = torch.cuda.get_device_capability()
    chosen = resolve_grouped_mm_backend("auto", torch.device("cuda"), torch.bfloat16, (1024, 2816, 1408))
    assert chosen == ("grouped_mm" if major >= 9 else "triton"), (torch.cuda.get_device_name(), chosen)
    torch.manual_seed(0)
    layer = moeflow.MoE(dim=1024, hidden=1408, num_experts=8, top_k=2, capacity_factor=0, device="cuda",
                        dtype=torch.bfloat16)
    loop = copy.deepcopy(layer)
    loop.experts.config = dataclasses.replace(layer.experts.config, backend="loop")
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    y, y_ref = layer(x), loop(x)
    assert_kernel_close(y, y_ref, torch.bfloat16, "default layer vs loop")
    grads = torch.autograd.grad(y, [x, *layer.parameters()], g)
    grads_ref = torch.autograd.grad(y_ref, [x, *loop.parameters()], g)
    for a, b in zip(grads, grads_ref):
        assert_kernel_close(a, b, torch.bfloat16, "grad")


# ------------------------------------------------------------------------------------------
# NCCL


def _case_nccl_layer(rank: int, world: int) -> None:
    """The expert-parallel layer over NCCL against the single process, fp64: capacity modes,
    pipelining, the data and sharded modes, the two-level exchange, the tuner."""
    from moeflow.parallel import make_groups

    device = torch.device("cuda", torch.cuda.current_device())
    E = 4 * world
    tokens = [11 + 3 * r for r in range(world)]
    for i, (cf, policy) in enumerate([(1.0, "position"), (0.0, "position"), (-0.8, "score"), (0.5, "bpr")]):
        layer = seeded_layer(E, 2, cf, policy, seed=10 + i, num_shared_experts=1)
        check_equivalence(rank, world, layer, tokens, seed=10 + i, what=f"cf={cf} {policy}", device=device)
    layer = seeded_layer(E, 2, 1.0, "position", seed=20)
    check_equivalence(rank, world, layer, tokens, seed=20, overlap_degree=2, what="pipelined", device=device)
    for parallel in ("data", "sharded"):
        layer = seeded_layer(E, 2, 0.0, "position", seed=21)
        check_equivalence(rank, world, layer, tokens, seed=21, parallel=parallel, what=parallel, device=device)
    groups = make_groups(world, node_size=world)
    layer = seeded_layer(E, 2, 1.0, "position", seed=22)
    check_equivalence(rank, world, layer, tokens, seed=22, hierarchy=groups.hierarchy, what="two-level", device=device)
    # the tuner times candidates and reduces the times over the ranks (a MAX all-reduce)
    layer = seeded_layer(E, 2, 1.0, "position", seed=23)
    ep = moeflow.parallel.expert_parallel(copy.deepcopy(layer).to(device))
    x = torch.randn(8, layer.config.dim, dtype=torch.float64, device=device, requires_grad=True)
    for _ in range(200):
        ep(x, overlap_degree="auto", parallel="auto").square().sum().backward()
        if ep.dispatcher.tuner.choices:
            break
    assert ep.dispatcher.tuner.choices


def _case_nccl_bf16(rank: int, world: int) -> None:
    """The fast path on the GPU (bf16, the default experts backend, dropless) through NCCL
    equals the local layer on this rank's rows when the group has one rank."""
    from moeflow.parallel import expert_parallel

    torch.manual_seed(0)
    layer = moeflow.MoE(dim=256, hidden=512, num_experts=8, top_k=2, capacity_factor=0, device="cuda",
                        dtype=torch.bfloat16)
    ep = expert_parallel(copy.deepcopy(layer))
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(rank))
    y = ep(x)
    if world == 1:
        assert_kernel_close(y, layer(x), torch.bfloat16, "bf16 expert-parallel vs local")
    y.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ep.parameters())
    # pipelined by slot chunks (grouped_mm, the Triton activation into the chunk buffers, the
    # weight gradients as one GEMM over all chunks' rows): degree 1's outputs and gradients
    from moeflow.parallel.strategies.chunk_ffn import ChunkedFFN

    assert ChunkedFFN.eligible(ep.experts, x)
    g = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(9))
    xr = x.clone().requires_grad_(True)
    params = [xr, *ep.experts.parameters()]
    y1 = ep(xr, overlap_degree=1)
    ref = torch.autograd.grad(y1, params, g)
    for degree in (2, 4):
        yd = ep(xr, overlap_degree=degree)
        assert_kernel_close(yd, y1, torch.bfloat16, f"pipelined degree {degree} output")
        got = torch.autograd.grad(yd, params, g)
        for a, b, name in zip(got, ref, ("x", "w_in", "w_out")):
            assert_kernel_close(a, b, torch.bfloat16, f"pipelined degree {degree} {name} grad")


CASES = {"nccl_layer": _case_nccl_layer, "nccl_bf16": _case_nccl_bf16}


@pytest.mark.distributed
def test_expert_parallel_layer_over_nccl_equals_one_process():
    spawn_ranks(_nccl_world(), __name__, "nccl_layer", backend="nccl")


@pytest.mark.distributed
def test_expert_parallel_bf16_fast_path_over_nccl():
    spawn_ranks(_nccl_world(), __name__, "nccl_bf16", backend="nccl")


@pytest.mark.distributed
def test_model_training_placement_and_checkpoints_over_nccl(tmp_path):
    """``test_parallel_dcp``'s model case (also run there on 2 gloo ranks on CPU, so it cannot rot
    between GPU runs) on the GPUs over NCCL."""
    spawn_ranks(_nccl_world(), "test_parallel_dcp", "model", str(tmp_path), "cuda", backend="nccl")


# ------------------------------------------------------------------------------------------
# the trainer on CUDA


@pytest.mark.e2e
def test_trainer_on_cuda_under_torchrun_trains_and_resumes(tmp_path):
    """``torchrun -m moeflow train --device cuda`` on one GPU (NCCL), a checkpoint, then
    ``--resume`` to more steps: the run continues from the checkpoint."""
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "moeflow", "train", "--device", "cuda", "--preset", "tiny", "--eval-every", "2", "--eval-batches", "1",
            "--checkpoint-every", "2", "--out", str(tmp_path / "run"), "--no-plot", "--no-progress", "--sample-tokens", "0"]
    first = subprocess.run([*base, "--steps", "4"], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = subprocess.run([*base, "--steps", "6", "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert history["step"][-1] == 6
