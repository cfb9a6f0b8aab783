"""Collectives over a process group, on the devices its backend takes (legend: moeflow.types).

Every ``torch.distributed`` collective of moeflow is called in this module (a test walks the
package's source to keep it so), which makes one rule hold everywhere: **a collective gets its
tensors on a device the group's backend takes**. NCCL takes only CUDA tensors (a CPU tensor
raises ``No backend type associated with device type cpu``), gloo works on CPU tensors (its
CUDA support is partial and slow, so moeflow never hands it CUDA tensors). A tensor on another
device is copied to the group's device (``group_device``: the current CUDA device under NCCL,
set from ``LOCAL_RANK`` by ``init_distributed``) for the collective and the result copied back,
so small host-side control data (counts, shapes, timings) can be built on the CPU by a caller
and still travel under NCCL; the data path (rows, weights, gradients) already lives on the
group's device and is never copied. Results come back on the device of the caller's tensor.

Backends' native collectives are used where they exist: ``reduce_scatter`` and
``all_gather`` into one tensor (NCCL implements them natively; gloo emulates the first with an
all-reduce, which only costs gloo's CPU runs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup  # for annotations outside this package

__all__ = [
    "ProcessGroup", "all_to_all_rows", "all_gather_rows", "all_gather_rows_with_header", "group_rank", "group_size",
    "group_device", "barrier", "CommTimer", "process_position", "sync", "gather_objects", "broadcast_object",
    "all_reduce_sum", "all_reduce_max", "start_all_to_all_rows", "all_gather_shards", "wait_all_to_all_rows",
    "all_to_all_equal", "start_all_to_all_into", "backend_name", "side_group",
]

# torch 2.13 renames the one-tensor variants (the old names warn); older torch has only the old
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _accepted_device_types(backend_config: str) -> frozenset[str]:
    """Device types a group takes, from ``dist.get_backend_config`` (``"cuda:nccl"``,
    ``"cpu:gloo,cuda:gloo"``, ``"cpu:gloo,cuda:nccl"``): every listed device except CUDA under
    gloo (partial and slow there; moeflow gives gloo CPU tensors)."""
    accepted = set()
    for entry in backend_config.split(","):
        device, _, backend = entry.strip().partition(":")
        if device and not (device == "cuda" and backend == "gloo"):
            accepted.add(device)
    return frozenset(accepted)


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s collectives take: CPU when the backend takes CPU
    tensors (gloo, or a mixed ``cpu:gloo,cuda:nccl`` group), else the current CUDA device
    (NCCL; ``init_distributed`` sets it from ``LOCAL_RANK``)."""
    accepted = _accepted_device_types(dist.get_backend_config(group))
    if "cpu" in accepted:
        return torch.device("cpu")
    if "cuda" in accepted:
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"moeflow's collectives run on cpu or cuda; this group's backend is "
                     f"{dist.get_backend_config(group)!r}")


def _device_for(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.device:
    """``x``'s device when ``group``'s backend takes it, else ``group_device(group)``."""
    if x.device.type in _accepted_device_types(dist.get_backend_config(group)):
        return x.device
    return group_device(group)


def _on_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` itself when ``group``'s backend takes its device, else a copy on ``group_device``."""
    return x.to(_device_for(x, group))


class CommTimer:
    """Accumulates the wall time spent inside exchanges (forward and backward) when attached to
    an exchange (``exchange.timer = CommTimer()``); the benchmark reads it. On CUDA it
    synchronises around each exchange, so attach it only when measuring."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def run(self, fn, device: torch.device):  # type: ignore[no-untyped-def]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def barrier(group: dist.ProcessGroup | None = None) -> None:
    dist.barrier(group=group)


def _require_on_group(x: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
    """For the collectives that write into the caller's buffers or keep them in flight
    (asynchronous exchanges): a copy to another device would break that, so refuse instead."""
    accepted = _accepted_device_types(dist.get_backend_config(group))
    if x.device.type not in accepted:
        raise ValueError(f"{what}: a {x.device.type} tensor cannot travel over this group (backend "
                         f"{dist.get_backend_config(group)!r} takes {sorted(accepted)}); put it on {group_device(group)}")


def process_position(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``, or ``(0, 1)`` when torch.distributed is not in use."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def sync(group: dist.ProcessGroup | None = None) -> None:
    """Barrier when torch.distributed is in use; nothing otherwise."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's JSON-able ``obj`` (a one-element list without torch.distributed). Under
    NCCL the pickled bytes travel through the current CUDA device (torch's object collectives
    do that themselves), so ``init_distributed`` must have set it."""
    if not dist.is_available() or not dist.is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Rank ``src``'s picklable ``obj`` on every rank of ``group`` (``src`` is a global rank,
    as in ``torch.distributed``); ``obj`` itself without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        y = _on_group(x, group)
        dist.all_reduce(y, op=op, group=group)
        if y is not x:
            x.copy_(y)
    return x


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place and return it; ``x`` unchanged without torch.distributed
    (so single-process code needs no branch). ``x`` may live on any device (module docstring)."""
    return _all_reduce(x, group, dist.ReduceOp.SUM)


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Elementwise maximum of ``x`` over ``group``, in place, like ``all_reduce_sum``."""
    return _all_reduce(x, group, dist.ReduceOp.MAX)


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group)


class _AllToAllRows(torch.autograd.Function):
    """Rows ``x[sum(send[:d]) : sum(send[:d+1])]`` go to rank d; the backward sends the
    gradients back along the same routes (the reverse exchange)."""

    @staticmethod
    def forward(ctx, x_ND, send_splits, recv_splits, group, timer):  # type: ignore[override]
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.timer = send_splits, recv_splits, group, timer
        return _exchange(x_ND, send_splits, recv_splits, group, timer)

    @staticmethod
    def backward(ctx, grad_MD):  # type: ignore[override]
        grad_in = _exchange(grad_MD, ctx.recv_splits, ctx.send_splits, ctx.group, ctx.timer)
        return grad_in, None, None, None, None


def _exchange(x_ND, send_splits, recv_splits, group, timer):  # type: ignore[no-untyped-def]
    src = _on_group(x_ND, group).contiguous()
    out = src.new_empty((sum(recv_splits), *x_ND.shape[1:]))

    def run():  # type: ignore[no-untyped-def]
        dist.all_to_all_single(out, src, recv_splits, send_splits, group=group)
        return out

    out = run() if timer is None else timer.run(run, src.device)
    return out.to(x_ND.device)


def all_to_all_rows(
    x_ND: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None,
    timer: CommTimer | None = None,
) -> torch.Tensor:
    """Exchange row blocks of uneven sizes; differentiable (backward = reverse exchange)."""
    return _AllToAllRows.apply(x_ND, list(send_splits), list(recv_splits), group, timer)


def all_gather_rows(x_ND: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``x_ND`` (row counts may differ), not differentiable."""
    return all_gather_rows_with_header(x_ND, (), group)


def all_gather_rows_with_header(
    x_ND: torch.Tensor, header: Sequence[int], group: dist.ProcessGroup | None,
    check: Callable[[list[list[int]]], None] | None = None,
) -> list[torch.Tensor]:
    """Every rank's ``x_ND`` (row counts may differ), not differentiable; every rank's
    ``header`` (ints, the same number on every rank) travels with the row counts in the first of
    the two collectives and is handed to ``check`` (rank order) before anything else happens, so
    a caller can make every rank raise the same error when they disagree on a call. Rows of
    another shape on some rank raise ``ValueError`` on every rank (the second collective could
    not match), naming each rank's shape."""
    W = dist.get_world_size(group)
    width = math.prod(x_ND.shape[1:])
    here = _device_for(x_ND, group)
    mine = torch.tensor([x_ND.shape[0], x_ND.dim(), width, *header], dtype=torch.long, device=here)
    every = torch.empty((W, mine.numel()), dtype=torch.long, device=here)
    _all_gather_single(every, mine.unsqueeze(0), group=group)
    rows = every.tolist()  # host sync: the row counts size the second collective
    if check is not None:
        check([r[3:] for r in rows])
    shapes = [(r[1], r[2]) for r in rows]
    if any(s != shapes[0] for s in shapes):
        raise ValueError("ranks gathered rows of different shapes (ndim, row width): "
                         + ", ".join(f"rank {i}: {s}" for i, s in enumerate(shapes)))
    counts = [r[0] for r in rows]
    P = max(counts)
    if P == 0:  # every rank sees the same counts, so every rank skips the second collective
        return [x_ND.new_empty((0, *x_ND.shape[1:])) for _ in range(W)]
    padded = x_ND.new_zeros((P, *x_ND.shape[1:]), device=here)
    padded[: x_ND.shape[0]] = x_ND
    parts = padded.new_empty((W, *padded.shape))
    _all_gather_single(parts.view(W * P, *padded.shape[1:]), padded, group=group)
    return [p[:c].to(x_ND.device) for p, c in zip(parts, counts)]


class _Pending:
    """The in-flight halves of one asynchronous exchange: the forward's work handle and, once
    backward has started it, the reverse exchange's handle and buffer."""

    __slots__ = ("work", "back_work", "back_out")

    def __init__(self) -> None:
        self.work = self.back_work = self.back_out = None


class _StartAllToAll(torch.autograd.Function):
    """Launch the exchange (``async_op``) and return its not-yet-filled output buffer; only
    ``_WaitAllToAll`` may read it. Backward: wait for the reverse exchange that
    ``_WaitAllToAll.backward`` launched and return its result as the input gradient (the
    incoming gradient is the one that exchange is already sending)."""

    @staticmethod
    def forward(ctx, x_ND, send_splits, recv_splits, group, pending):  # type: ignore[override]
        out = x_ND.new_empty((sum(recv_splits), *x_ND.shape[1:]))
        pending.work = start_all_to_all_into(out, x_ND.contiguous(), send_splits, recv_splits, group, "start_all_to_all_rows")
        ctx.pending = pending
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        pending = ctx.pending
        pending.back_work.wait()
        grad_in = pending.back_out
        pending.back_work = pending.back_out = None  # the work holds its tensors: break the cycle
        return grad_in, None, None, None, None


class _WaitAllToAll(torch.autograd.Function):
    """Wait for the exchange, then pass its buffer on (as a view). Backward: launch the reverse
    exchange of the incoming gradient asynchronously (``_StartAllToAll.backward`` collects it)
    and pass the gradient through unchanged, so the exchange runs while autograd
    back-propagates other chunks."""

    @staticmethod
    def forward(ctx, out_MD, send_splits, recv_splits, group, pending):  # type: ignore[override]
        pending.work.wait()
        pending.work = None  # it holds the buffer, whose grad_fn holds ``pending``: no cycle
        ctx.splits, ctx.group, ctx.pending = (send_splits, recv_splits), group, pending
        return out_MD.view_as(out_MD)

    @staticmethod
    def backward(ctx, grad_MD):  # type: ignore[override]
        send_splits, recv_splits = ctx.splits
        grad_MD = grad_MD.contiguous()
        back = grad_MD.new_empty((sum(send_splits), *grad_MD.shape[1:]))
        ctx.pending.back_out = back
        ctx.pending.back_work = start_all_to_all_into(back, grad_MD, recv_splits, send_splits, ctx.group)
        return grad_MD, None, None, None, None


def start_all_to_all_rows(
    x_ND: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, _Pending]:
    """Asynchronous, differentiable ``all_to_all_rows``: returns ``(buffer, pending)``; pass both
    to ``wait_all_to_all_rows`` before reading the rows. Every rank must start its exchanges in
    the same order (they are collectives); in backward the reverse exchanges run asynchronously
    too, overlapping with the back-propagation of whatever autograd runs in between."""
    pending = _Pending()
    out = _StartAllToAll.apply(x_ND, list(send_splits), list(recv_splits), group, pending)
    return out, pending


def wait_all_to_all_rows(
    out_MD: torch.Tensor, pending: _Pending, send_splits: list[int], recv_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """The received rows of an exchange started with ``start_all_to_all_rows`` (same splits)."""
    return _WaitAllToAll.apply(out_MD, list(send_splits), list(recv_splits), group, pending)


class _AllGatherShards(torch.autograd.Function):
    """Forward: every rank's ``[e, ...]`` shard, concatenated in rank order (``[W*e, ...]``).
    Backward: the gradients of the full tensor summed over the ranks (each rank used it on its
    own tokens), of which this rank gets its slice: one reduce-scatter (NCCL's native one moves
    half the bytes of an all-reduce followed by a slice)."""

    @staticmethod
    def forward(ctx, x_eX, group):  # type: ignore[override]
        W = dist.get_world_size(group)
        ctx.group = group
        src = _on_group(x_eX, group).contiguous()
        out = src.new_empty((W * x_eX.shape[0], *x_eX.shape[1:]))
        _all_gather_single(out, src, group=group)
        return out.to(x_eX.device)

    @staticmethod
    def backward(ctx, grad_EX):  # type: ignore[override]
        W = dist.get_world_size(ctx.group)
        src = _on_group(grad_EX, ctx.group).contiguous()
        out = src.new_empty((src.shape[0] // W, *src.shape[1:]))
        _reduce_scatter_single(out, src, group=ctx.group)
        return out.to(grad_EX.device), None


def all_gather_shards(x_eX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-gather of equal shards along dim 0 (backward: sum, then this shard)."""
    return _AllGatherShards.apply(x_eX, group)


def all_to_all_equal(out_N: torch.Tensor, x_N: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Equal-split all-to-all into a preallocated buffer: block ``d`` of ``x_N``'s ``W`` equal
    blocks (along dim 0) goes to rank ``d``, ``out_N`` (like ``x_N``) gets block ``r`` of every
    rank ``r``. Allocates nothing, so ``moeflow.bench.calibrate`` times the collective alone:
    both tensors must be on a device the group takes (``group_device``), or ``ValueError``."""
    start_all_to_all_into(out_N, x_N, None, None, group, "all_to_all_equal").wait()


def start_all_to_all_into(out_ND, x_ND, send_splits, recv_splits, group, what="all_to_all"):  # type: ignore[no-untyped-def]
    """Launch the exchange of ``x_ND``'s row blocks (``send_splits``, None: equal) into the
    caller's ``out_ND``, asynchronously; returns the work. Not differentiable; both contiguous,
    on a device the group takes (else ``ValueError`` naming ``what``)."""
    _require_on_group(out_ND, group, what)
    _require_on_group(x_ND, group, what)
    return dist.all_to_all_single(out_ND, x_ND, recv_splits, send_splits, group=group, async_op=True)


def backend_name(group: dist.ProcessGroup | None = None) -> str:
    """The torch.distributed backend of ``group`` (``"gloo"``, ``"nccl"``, ...), for reports."""
    return str(dist.get_backend(group))


_SIDE_GROUPS: dict[int, dist.ProcessGroup] = {}  # id of the default group -> its side group


def side_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A gloo group over the same ranks as ``group`` (the whole job: ``None`` or a group of every
    rank), for collectives that a background thread runs beside the main thread's (an
    asynchronous checkpoint's completion): collectives of one group must come in the same order
    on every rank, and a second group keeps the two streams apart. Created on first use, by
    every rank at the same point (``new_group`` is a collective), then reused. ``None`` without
    torch.distributed. Raises ``ValueError`` for a group smaller than the job."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    if dist.get_world_size(group) != world:
        raise ValueError(f"a side group is made over the whole job ({world} ranks); the given group has "
                         f"{dist.get_world_size(group)}")
    key = id(dist.group.WORLD)  # a new process group (a restarted job) gets a new side group
    if key not in _SIDE_GROUPS:
        _SIDE_GROUPS[key] = dist.new_group(list(range(world)), backend="gloo")
    return _SIDE_GROUPS[key]
