"""Helpers shared by the test modules (a plain module: pytest puts tests/ on sys.path).

Fixtures live in ``conftest.py``; everything a test module imports by name lives here:

- building layers and models: ``randomize_``, ``make_layer`` (a generator draws the parameters),
  ``seeded_layer`` (an integer seed does: every rank of a multi-rank test builds the same layer),
  ``small_gpt``; inputs: ``rand``, ``random_counts``;
- comparing: ``output_and_grads``, ``rel_err``, ``assert_close_rel``, ``compare_layer_with``,
  ``check_equivalence`` (an expert-parallel layer against the single process, on gloo ranks);
- running on ranks: ``spawn_ranks`` (gloo on 127.0.0.1; a rank's failure or a hang fails the test);
- ``needs_cuda``: skip without CUDA (with ``@pytest.mark.gpu``);
- ``assert_offloaded_grads_equal``: an offloaded copy's loss and gradients against the model's;
- ``ffn_operands``: random rows and expert weights for ``moeflow.experts.lean`` (either layout);
- ``KeepFp64``: transformers' fp32 casts of fp64 tensors (norms, softmax, routers) kept in fp64,
  so an fp64 comparison with its modules checks the formulas at fp64's precision;
- ``file_states``: every file and folder under a directory with its hash and mtime (did an
  operation touch nothing?); ``train_tiny_run``: a one-step ``moeflow train`` run to read back;
- torchrun jobs: ``torchrun_cmd`` (one node's agent; static or c10d rendezvous), ``TORCHRUN_ENV``,
  ``rank_pids`` (the ranks' process ids, to kill one), ``job_pids`` (every rank of a job),
  ``agent_ranks`` (an agent's ranks, from a whole /proc scan), ``descendants``, ``kill_node`` (an
  agent and its ranks: a lost node), ``kill_job`` (what a job left behind).
"""

from __future__ import annotations

import atexit
import copy
import datetime
import hashlib
import importlib
import os
import queue
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.overrides import TorchFunctionMode

import moeflow
from moeflow import DispatchConfig, RouterConfig
from moeflow.kernels.activation import GATED
from moeflow.models import GPTConfig, MoEGPT
from moeflow.parallel import all_reduce_gradients, dense_parameters, expert_parallel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class KeepFp64(TorchFunctionMode):
    """Inside: ``x.to(torch.float32)`` / ``x.float()`` of an fp64 tensor is ``x``, and a
    ``dtype=torch.float32`` argument next to an fp64 tensor becomes fp64.

    transformers computes its RMSNorms, eager softmax, routers and rotary tables in fp32
    whatever the input (``.to(torch.float32)``, ``softmax(dtype=torch.float32)``, ``.float()``):
    for fp64 inputs a downcast, which would make an fp64 comparison measure those casts (~1e-7)
    rather than the formulas. Under this mode its modules stay in fp64 throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.dtype == torch.float64:
            to_fp32 = func is torch.Tensor.to and any(a is torch.float32 for a in (*args[1:], kwargs.get("dtype")))
            if func is torch.Tensor.float or to_fp32:
                return x
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- layers, models, inputs


def randomize_(module: nn.Module, gen: torch.Generator, std: float = 0.5) -> nn.Module:
    """Overwrite every parameter with fresh N(0, std^2) values so nothing is near zero."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return module


def make_layer(
    gen: torch.Generator,
    *,
    dim: int = 8,
    hidden: int = 8,
    num_experts: int = 6,
    top_k: int = 2,
    dtype: torch.dtype = torch.float64,
    std: float = 0.5,
    router: moeflow.RouterConfig | None = None,
    dispatch: moeflow.DispatchConfig | None = None,
    experts_cfg: moeflow.ExpertsConfig | None = None,
    experts: nn.Module | None = None,
    eval_mode: bool = True,
    **fields: object,
) -> moeflow.MoE:
    """A small ``MoE`` with every parameter redrawn from N(0, std^2) (routing is non-trivial)."""
    kw: dict[str, object] = dict(fields)
    if router is not None:
        kw["router"] = router
    if dispatch is not None:
        kw["dispatch"] = dispatch
    if experts_cfg is not None:
        kw["experts"] = experts_cfg
    cfg = moeflow.MoEConfig(dim=dim, hidden=hidden, num_experts=num_experts, top_k=top_k, **kw)  # type: ignore[arg-type]
    layer = moeflow.MoE(config=cfg, experts_module=experts, dtype=dtype)
    randomize_(layer, gen, std=std)
    layer.train(not eval_mode)
    return layer


def seeded_layer(
    E: int,
    k: int,
    cf: float,
    policy: str,
    weight_at: str = "combine",
    *,
    seed: int,
    dim: int = 8,
    hidden: int = 8,
    router: moeflow.RouterConfig | None = None,
    experts: moeflow.ExpertsConfig | None = None,
    **fields: object,
) -> moeflow.MoE:
    """``make_layer`` from an integer: the multi-rank tests' fp64 eval layer, the same on every rank.

    The global RNG is seeded with ``seed`` (later draws from it agree between ranks too), the
    parameters are drawn from ``seed + 1``; no balance loss unless ``router`` says otherwise.
    """
    torch.manual_seed(seed)
    return make_layer(
        torch.Generator().manual_seed(seed + 1), dim=dim, hidden=hidden, num_experts=E, top_k=k, capacity_factor=cf,
        router=RouterConfig(load_balance_coef=0.0) if router is None else router,
        dispatch=DispatchConfig(drop_policy=policy, weight_at=weight_at),  # type: ignore[arg-type]
        experts_cfg=experts, **fields,
    )


def small_gpt(**kw: object) -> MoEGPT:
    """A 3-block MoE GPT (MoE on every second block, grouped-query attention); ``kw`` overrides."""
    base = dict(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=24, moe_every=2,
                num_experts=4, top_k=2, expert_hidden=24)
    return MoEGPT(GPTConfig(**{**base, **kw}))  # type: ignore[arg-type]


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


def random_counts(gen: torch.Generator, E: int, R: int, empty: int) -> torch.Tensor:
    """E group sizes summing to R with `empty` empty groups."""
    weights = torch.rand(E, generator=gen) + 0.1
    weights[torch.randperm(E, generator=gen)[:empty]] = 0
    counts = torch.floor(weights / weights.sum() * R).long()
    counts[int(torch.argmax(weights))] += R - int(counts.sum())
    return counts


# ----------------------------------------------------------------------------- comparisons


def output_and_grads(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``y = fn(x)`` and the gradients of ``<y, grad_out>`` w.r.t. ``x`` and ``params``.

    Parameters that do not influence ``y`` get an exact zero gradient (not ``None``) so two
    implementations can be compared entry by entry.
    """
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    inputs = [x, *params]
    grads = torch.autograd.grad((y * grad_out).sum(), inputs, allow_unused=True)
    return y.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(inputs, grads)]


def rel_err(actual: torch.Tensor, expected: torch.Tensor, *, norm: str = "max") -> float:
    """Error of ``actual`` relative to ``expected``, computed in fp64.

    ``norm="max"``: max |actual - expected| / max |expected| (the largest reference magnitude,
    floored at 1e-30); ``norm="fro"``: ||actual - expected|| / ||expected|| over all entries.
    """
    a, b = actual.detach().double(), expected.detach().double()
    if norm == "fro":
        return ((a - b).norm() / b.norm()).item()
    if norm != "max":
        raise ValueError(f"norm must be 'max' or 'fro', got {norm!r}")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_close_rel(
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: float,
    what: str = "",
    *,
    floor: float = 1.0,
    same_dtype: bool = True,
) -> None:
    """Max abs error <= ``tol`` x max(largest magnitude of ``expected``, ``floor``), in fp64.

    Norm-wise, not per entry (flash-attention style). ``floor=1.0``: absolute below magnitude 1;
    the kernel tests pass a tiny floor (relative at every magnitude) and ``same_dtype=False``.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if same_dtype:
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, b = actual.detach().double(), expected.detach().double()
    scale = max(b.abs().max().item(), 1e-300) if b.numel() else 1.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    assert err <= tol * max(scale, floor), f"{what}: max abs err {err:.3e} (scale {scale:.3e}, tol {tol:.1e})"


def compare_layer_with(
    layer: moeflow.MoE,
    reference: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    gen: torch.Generator,
    *,
    tol: float = 1e-10,
    call: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Outputs and the gradients of x and every parameter of ``layer`` agree with ``reference``."""
    names, params = zip(*layer.named_parameters())
    grad_out = rand(gen, *x.shape, dtype=x.dtype)
    y, grads = output_and_grads(call or layer, x, params, grad_out)
    y_ref, grads_ref = output_and_grads(reference, x, params, grad_out)
    assert_close_rel(y, y_ref, tol, "output")
    for name, g, g_ref in zip(("x", *names), grads, grads_ref):
        assert_close_rel(g, g_ref, tol, f"grad of {name}")


def check_equivalence(
    rank: int, world: int, layer: moeflow.MoE, tokens: list[int], seed: int, what: str, hierarchy=None,
    overlap_degree: int | str = 1, parallel: str = "expert", *, shard=None, expert_view=None, after_backward=None,
    device: torch.device | str = "cpu",
):  # type: ignore[no-untyped-def]
    """Run ``layer`` on the concatenated batch and a parallel copy on this rank's part; compare
    outputs, input, expert and dense gradients and one SGD step. ``shard(copy) -> parallel
    layer`` (default ``expert_parallel``), ``expert_view(name, full [E, ...] tensor) -> what this
    rank holds`` (default its contiguous block), ``after_backward(parallel layer)``. Returns
    ``(ref, parallel layer)`` for further checks. Call it on every rank of a process group
    (gloo, or NCCL with ``device`` this rank's GPU: the layer and the inputs move there)."""
    D = layer.config.dim
    layer = layer.to(device)
    gen = torch.Generator().manual_seed(seed + 2)
    xs = [torch.randn(t, D, generator=gen, dtype=torch.float64).to(device) for t in tokens]
    gs = [torch.randn(t, D, generator=gen, dtype=torch.float64).to(device) for t in tokens]
    start = sum(tokens[:rank])
    sl = slice(start, start + tokens[rank])

    ref = copy.deepcopy(layer)
    x_all = torch.cat(xs).requires_grad_(True)
    y_all = ref(x_all)
    (y_all * torch.cat(gs)).sum().backward()

    e = layer.config.num_experts // world
    if expert_view is None:
        expert_view = lambda name, t: t[rank * e : (rank + 1) * e]  # noqa: E731
    ep = (shard or (lambda m: expert_parallel(m, hierarchy=hierarchy)))(copy.deepcopy(layer))
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x, overlap_degree=overlap_degree, parallel=parallel)
    (y * gs[rank]).sum().backward()
    if after_backward is not None:
        after_backward(ep)

    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, y_all[sl].detach(), **tol, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(x.grad, x_all.grad[sl], **tol, msg=lambda m: f"{what} input grad: {m}")
    ref_experts = dict(ref.experts.named_parameters())
    for name, p in ep.experts.named_parameters():
        expected = expert_view(name, ref_experts[name].grad)
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
    experts_prefix = {id(p): name for name, p in ep.experts.named_parameters()}
    for name, p in ep.named_parameters():
        expected = ref_dense[name]
        if getattr(p, "moeflow_expert", False):
            expected = expert_view(experts_prefix[id(p)], expected.detach())
        torch.testing.assert_close(p, expected, **tol, msg=lambda m: f"{what} {name} after step: {m}")
    return ref, ep


def assert_offloaded_grads_equal(model: MoEGPT, offloaded: MoEGPT, store, idx: torch.Tensor,  # type: ignore[no-untyped-def]
                                 tgt: torch.Tensor) -> None:
    """One backward of the loss (with the aux loss) on ``model`` and on its copy ``offloaded``,
    whose experts ``store`` holds (``trainable``): the loss, every dense gradient and every
    expert gradient (the store's ``grads``) equal the in-memory ones bit for bit."""
    loss_ref = model.loss(idx, tgt) + moeflow.aux_loss(model)
    loss = offloaded.loss(idx, tgt) + moeflow.aux_loss(offloaded)
    assert torch.equal(loss, loss_ref)
    loss_ref.backward()
    loss.backward()
    store.wait_grads()
    dense_ref = {n: p for n, p in model.named_parameters() if ".experts." not in n}
    for name, p in offloaded.named_parameters():
        assert torch.equal(p.grad, dense_ref[name].grad), name
    for i, layer in enumerate(moeflow.moe_layers(model)):
        for name, p in layer.experts.named_parameters():
            assert torch.equal(store.grads[i][name], p.grad), (i, name)


# ----------------------------------------------------------------------------- gloo ranks

TIMEOUT_S = 240


def _mutation_hits(*, clear: bool = False) -> list[str]:
    """The library functions mutmut's trampolines saw run in this process during ``make
    mutation``'s coverage pass (``MUTANT_UNDER_TEST=stats``; empty otherwise). A spawned rank
    hands them to ``spawn_ranks``, which adds them to the test's own: without that, code that
    runs only in ranks (the tuner's reductions, the exchanges) would have no covering test and
    its mutants would never be run."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or "mutmut.state" not in sys.modules:
        return []
    from mutmut.state import state  # only under mutmut (the dev extra)

    seen = sorted(state()._stats)
    if clear:  # a pooled rank reports each case's own
        state()._stats.clear()
    return seen


def _add_mutation_hits(hits: Sequence[str]) -> None:
    if hits and "mutmut.state" in sys.modules:
        from mutmut.state import state

        state()._stats.update(hits)


def _join_group(rank: int, world: int, store_file: str, backend: str) -> None:
    """A spawned rank's start: one intra-op thread, then the process group."""
    torch.set_num_threads(1)
    kw: dict[str, object] = {}
    if backend == "nccl":  # one GPU per rank, as moeflow.parallel.init_distributed does
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    # a file rendezvous: no port to pick, so no race with other processes for it
    dist.init_process_group(
        backend, init_method=f"file://{store_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=90), **kw,
    )


def _entry(rank: int, world: int, store_file: str, module: str, case: str, errors, args: tuple, done=None,
           backend: str = "gloo", hits=None) -> None:
    _join_group(rank, world, store_file, backend)
    passed = False
    try:
        getattr(importlib.import_module(module), "CASES")[case](rank, world, *args)
        passed = True
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        try:
            dist.barrier()
            if passed and done is not None:  # the case and the barrier after it passed here
                done.put(rank)
            if hits is not None and (seen := _mutation_hits()):
                hits.put(seen)
        finally:
            dist.destroy_process_group()


def spawn_ranks(world: int, module: str, case: str, *args: object, backend: str = "gloo") -> None:
    """Run ``module.CASES[case](rank, world, *args)`` on ``world`` ranks of ``backend`` (gloo on
    127.0.0.1; ``"nccl"``: rank r on GPU r); fail (never hang) after TIMEOUT_S.

    ``module`` is the test module's ``__name__``: each rank imports it by name (tests/ is on the
    spawned processes' sys.path too) and looks the case up in its ``CASES`` dict.

    gloo cases run in a pool of ranks kept per world size for the whole session (``_RankPool``):
    starting a rank costs about 3 s of CPU (importing torch and moeflow), more than most cases,
    so a fresh set per call made up about a third of ``make test``. Each case still starts from
    what a fresh rank has (see ``_RankPool``); a failed or timed-out case ends the pool, and the
    next call starts a new one. nccl runs fresh ranks.
    """
    if backend == "gloo":
        _RankPool.for_world(world).run(module, case, args)
        return
    _spawn_fresh(world, module, case, args, backend)


def _spawn_fresh(world: int, module: str, case: str, args: tuple, backend: str) -> None:
    """One fresh process per rank for one case (the nccl ranks of the GPU tests)."""
    ctx = mp.get_context("spawn")
    errors, done, hits = ctx.SimpleQueue(), ctx.SimpleQueue(), ctx.SimpleQueue()
    store_dir = tempfile.mkdtemp(prefix="moeflow-rdzv-")
    store_file = os.path.join(store_dir, "store")
    proc = mp.start_processes(
        _entry, args=(world, store_file, module, case, errors, args, done, backend, hits), nprocs=world, join=False,
        start_method="spawn",
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    try:
        while not proc.join(timeout=2):
            while not hits.empty():  # read as they come: a rank must not block writing them
                _add_mutation_hits(hits.get())
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"{case} on {world} ranks did not finish in {TIMEOUT_S}s")
        while not hits.empty():
            _add_mutation_hits(hits.get())
    except Exception as err:
        for p in proc.processes:
            if p.is_alive():
                p.kill()
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        finished = set()
        while not done.empty():
            finished.add(done.get())
        if not msgs and finished == set(range(world)) and not isinstance(err, TimeoutError):
            # every rank ran the case, its assertions and the closing barrier; a rank then died
            # tearing down (seen rarely on this 2-core VM under load: gloo's "terminate called
            # without an active exception" while the process group is destroyed or at exit).
            # That is not a result of the code under test: report it and pass.
            warnings.warn(f"{case} on {world} ranks: every rank passed, then one died at exit: {err}", stacklevel=2)
            return
        raise AssertionError(f"{case} failed on {world} ranks: {err}\n" + "\n".join(msgs)) from None
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


# how long the pool waits for the other ranks' reports after one rank failed: a case that raises
# on every rank (a refusal every rank must see) reports each; a rank left waiting in a collective
# for the failed one never reports, and the pool is ended
_FAILURE_GRACE_S = 3.0


class _RankPool:
    """``world`` gloo ranks (spawned processes, one process group) that run the cases of any
    test module, one after another.

    Before each case a rank gets the state a freshly spawned rank had: the parent's environment
    and working directory as they are at the call, one intra-op thread, fp32 as the default
    dtype, no default device, gradients on, deterministic algorithms off, and the global RNG at
    torch's start-up seed (a case that draws without seeding draws what it drew in a fresh
    process). A module global of moeflow or of the tests that a case rebinds (a function
    patched to fail, as the fault tests do) is bound back after it (``_module_globals``); what a
    case leaves inside an object (moeflow's caches: the kernel backend probes, registered custom
    ops, the same in every process) stays. After a case every rank passes a barrier (no rank
    runs ahead into the next one). A rank that fails reports its
    traceback and exits, which ends the pool; so does a rank that dies or a case that runs past
    TIMEOUT_S. A rank exits by itself when the process that started it is gone (a mutmut worker
    ends with ``os._exit``, so no atexit handler of it runs).
    """

    _open: dict[int, _RankPool] = {}  # by world size

    def __init__(self, world: int) -> None:
        self.world = world
        ctx = mp.get_context("spawn")
        self.store_dir = tempfile.mkdtemp(prefix="moeflow-rdzv-")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_pool_rank, args=(rank, world, os.path.join(self.store_dir, "store"),
                                                 self.tasks[rank], self.results, os.getpid()), daemon=False)
            for rank in range(world)
        ]
        for p in self.procs:
            p.start()

    @classmethod
    def for_world(cls, world: int) -> _RankPool:
        """The pool of ``world`` ranks, started when there is none or its last one ended."""
        pool = cls._open.get(world)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close()
            pool = cls._open[world] = cls(world)
        return pool

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, module: str, case: str, args: tuple) -> None:
        """Run ``module.CASES[case]`` on every rank; raise AssertionError (every failed rank's
        traceback, in the order they came) or TimeoutError, ending the pool, unless every rank
        passed."""
        task = (module, case, args, dict(os.environ), os.getcwd())
        for q in self.tasks:
            q.put(task)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
        passed: set[int] = set()
        msgs: list[str] = []
        failed_at: datetime.datetime | None = None
        while len(passed) + len(msgs) < self.world:
            now = datetime.datetime.now()
            if failed_at is not None and (now - failed_at).total_seconds() > _FAILURE_GRACE_S:
                break
            if now > deadline:
                self.close(kill=True)
                raise TimeoutError(f"{case} on {self.world} ranks did not finish in {TIMEOUT_S}s")
            try:
                rank, ok, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                if failed_at is None and not self.alive():
                    dead = [f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(self.procs) if not p.is_alive()]
                    msgs.append("died without a report: " + ", ".join(dead))
                    failed_at = datetime.datetime.now()
                continue
            if ok:
                passed.add(rank)
                _add_mutation_hits(payload)
            else:
                msgs.append(payload)
                failed_at = failed_at or datetime.datetime.now()
        if msgs:
            self.close(kill=True)  # a rank may be waiting for the failed one in a collective
            raise AssertionError(f"{case} failed on {self.world} ranks\n" + "\n".join(msgs))

    def close(self, *, kill: bool = False) -> None:
        """End every rank (told to stop when idle; killed when ``kill`` or when it does not stop)
        and remove the rendezvous file."""
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=0 if kill else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in (*self.tasks, self.results):
            q.close()
            q.cancel_join_thread()
        shutil.rmtree(self.store_dir, ignore_errors=True)
        if _RankPool._open.get(self.world) is self:
            del _RankPool._open[self.world]


def close_rank_pool() -> None:
    """End the pools of gloo ranks that are running (conftest calls it when the session ends)."""
    for pool in list(_RankPool._open.values()):
        pool.close()


atexit.register(close_rank_pool)


_MISSING = object()


def _module_globals() -> dict[str, tuple[object, dict[str, object]]]:
    """The globals of every loaded moeflow and test module (``helpers``, ``test_*``, ``conftest``),
    to bind back after a case: ``{module name: (module, {global: object})}``."""
    tests_dir = str(Path(__file__).resolve().parent)
    return {name: (mod, dict(vars(mod))) for name, mod in list(sys.modules.items())
            if name.split(".")[0] == "moeflow" or os.path.dirname(getattr(mod, "__file__", None) or "") == tests_dir}


def _restore_module_globals(saved: dict[str, tuple[object, dict[str, object]]]) -> None:
    """Bind back every global of ``saved`` that a case rebound or deleted (names a case added
    stay: a submodule imported since is bound on its package, and must stay bound)."""
    for mod, before in saved.values():
        now = vars(mod)
        for key, value in before.items():
            if now.get(key, _MISSING) is not value:
                now[key] = value


def _pool_rank(rank: int, world: int, store_file: str, tasks, results, parent_pid: int) -> None:
    """One rank of a ``_RankPool``: join the process group, then run cases until told to stop."""
    start_seed = torch.initial_seed()
    _join_group(rank, world, store_file, "gloo")
    while True:
        try:
            task = tasks.get(timeout=2)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the parent is gone: nothing will come
                os._exit(0)
            continue
        if task is None:
            break
        module, case, args, env, cwd = task
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.manual_seed(start_seed)
        try:
            cases = getattr(importlib.import_module(module), "CASES")
            saved = _module_globals()
            try:
                cases[case](rank, world, *args)
            finally:
                _restore_module_globals(saved)
            dist.barrier()
        except BaseException:  # noqa: BLE001 - reported to the parent, which ends the pool
            results.put((rank, False, f"rank {rank}:\n{traceback.format_exc()}"))
            results.close()
            results.join_thread()
            os._exit(1)  # a rank waiting for this one in a collective fails at once
        results.put((rank, True, _mutation_hits(clear=True)))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- files


def file_states(root: Path) -> dict[str, tuple[str, int]]:
    """Every file and folder under ``root`` by relative path: ``(sha256 or "dir", mtime in ns)``.
    Equal before and after an operation when it wrote, created, removed and renamed nothing
    there (a folder's mtime changes when an entry is added or removed)."""
    states = {}
    for path in sorted(Path(root).rglob("*")):
        kind = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        states[str(path.relative_to(root))] = (kind, path.stat().st_mtime_ns)
    states["."] = ("dir", Path(root).stat().st_mtime_ns)
    return states


def train_tiny_run(out: Path) -> str:
    """``moeflow train`` for one step into ``out`` (batch 2, 16-token sequences, one thread; no
    progress bar, plot or sample): the run directory, as ``moeflow generate`` takes it."""
    from moeflow.cli.main import main

    assert main(["train", "--out", str(out), "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                 "--eval-batches", "1", "--no-progress", "--no-plot", "--sample-tokens", "0", "--threads", "1"]) == 0
    return str(out)


# ----------------------------------------------------------------------------- torchrun jobs


def torchrun_cmd(*args: str, nproc: int = 2, max_restarts: int = 0, rdzv: str | None = None, nnodes: int = 1,
                 node_rank: int = 0) -> list[str]:
    """torchrun running ``args`` (a script, or ``-m module ...``) on ``nproc`` ranks of this machine: a
    static rendezvous on a free port of 127.0.0.1, or with ``rdzv="127.0.0.1:PORT"`` the agent of node
    ``node_rank`` of ``nnodes`` in a c10d rendezvous there. Run it with ``TORCHRUN_ENV`` (1 thread a rank)."""
    from moeflow.parallel.launch.torchrun import free_port

    where = (["--master-addr=127.0.0.1", f"--master-port={free_port()}"] if rdzv is None else
             [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}"])
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", *where, *args]


TORCHRUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def rank_pids(pid: int) -> dict[int, int]:
    """``{RANK: pid}`` of the torchrun ranks among the descendants of process ``pid`` (read from /proc)."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            todo += [int(k) for t in Path(f"/proc/{p}/task").iterdir() for k in (t / "children").read_text().split()]
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{p}/environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:  # it exited meanwhile
            continue
        if p != pid and b"TORCHELASTIC_RUN_ID" in env and b"RANK" in env:
            found[int(env[b"RANK"])] = p
    return found


def job_pids(rdzv_id: str) -> list[int]:
    """The process ids of every torchrun rank of the job ``rdzv_id`` on this machine (their
    ``TORCHELASTIC_RUN_ID``; read from /proc), whichever agent started them."""
    needle = b"TORCHELASTIC_RUN_ID=" + rdzv_id.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # not ours to read, or it exited meanwhile
            continue
    return found


def _sigkill(pids: Sequence[int]) -> None:
    """SIGKILL each process and its process group (when it leads one)."""
    import signal

    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _children() -> dict[int, list[int]]:
    """Every process's children, from each process's parent in /proc/*/stat (a whole scan: the
    ``/proc/PID/task/TID/children`` files can miss a child, as seen here under load)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm) state"
        children.setdefault(parent, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """The process ids of every descendant of process ``pid``."""
    children, found, todo = _children(), [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def agent_ranks(agent_pid: int) -> dict[int, int]:
    """``{RANK: pid}`` of the ranks a torchrun agent started (its children with torchrun's
    environment); unlike ``rank_pids`` it never misses one."""
    found = {}
    for pid in _children().get(agent_pid, []):
        try:
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:  # it exited meanwhile
            continue
        if b"TORCHELASTIC_RUN_ID" in env and b"RANK" in env:
            found[int(env[b"RANK"])] = pid
    return found


def kill_node(agent_pid: int) -> dict[int, int]:
    """SIGKILL a simulated node: the torchrun agent ``agent_pid`` (and its process group: start
    it with ``start_new_session=True``) and every process under it: its ranks, each of which
    torchrun starts in a session of its own (killing the agent's group alone leaves them
    training), and theirs. Call it only while the agent has not been waited for (its pid is
    still its own). Returns the ``{RANK: pid}`` of the ranks it killed."""
    ranks = agent_ranks(agent_pid)
    _sigkill([agent_pid, *descendants(agent_pid), *ranks.values()])
    return ranks


def kill_job(rdzv_id: str) -> None:
    """SIGKILL every rank of the torchrun job ``rdzv_id`` left on this machine (a test's cleanup)."""
    _sigkill(job_pids(rdzv_id))


def ffn_operands(gen: torch.Generator, gemm: str, activation: str, dtype: torch.dtype, *, E: int, C: int,
                 D: int = 8, H: int = 16, min_rows: int = 0, empty: int = 1):
    """``(x, w_in, w_out, offs)`` for ``lean_ffn``, all requiring grad but ``offs``: ``x`` is
    ``[E, C, D]`` for ``gemm="bmm"`` (``offs`` None), else ``[R, D]`` grouped by expert with
    ``min_rows..2C-1`` rows per expert, expert ``empty`` given none, and ``offs`` the int64
    inclusive cumulative counts (int32 for ``lean_ffn``'s ``grouped_mm``)."""
    F = 2 * H if activation in GATED else H
    w_in = torch.randn(E, D, F, generator=gen, dtype=dtype).requires_grad_()
    w_out = torch.randn(E, H, D, generator=gen, dtype=dtype).requires_grad_()
    if gemm == "bmm":
        return torch.randn(E, C, D, generator=gen, dtype=dtype).requires_grad_(), w_in, w_out, None
    counts = torch.randint(min_rows, 2 * C, (E,), generator=gen)
    counts[empty] = 0
    offs = counts.cumsum(0)
    return torch.randn(int(offs[-1]), D, generator=gen, dtype=dtype).requires_grad_(), w_in, w_out, offs


class StoppedAfterCheckpoint(Exception):
    """Raised by ``run_until_checkpoint`` right after the checkpoint it waits for is on disk."""


def run_until_checkpoint(step: int, train: Callable[[], object]) -> None:
    """Run ``train()`` (a ``moeflow.train.lm.train_lm`` call) and stop it right after the
    checkpoint of ``step`` is complete, as a job killed there would be: the way resumption tests
    interrupt a run at a known step."""
    import moeflow.train.lm as lm

    save = lm.save_checkpoint_async

    def save_then_stop(root, at, *args, **kw):  # type: ignore[no-untyped-def]
        pending = save(root, at, *args, **kw)
        if at == step:
            pending.wait()
            raise StoppedAfterCheckpoint
        return pending

    lm.save_checkpoint_async = save_then_stop
    try:
        with pytest.raises(StoppedAfterCheckpoint):
            train()
    finally:
        lm.save_checkpoint_async = save
