"""Memory traffic of one ``moeflow.MoE`` forward+backward outside the expert GEMMs, stage by
stage, next to the compulsory traffic of an unfused layer (legend: moeflow.types).

    python -m bench.traffic                       # both shapes, fp32 and bf16, dropless and cf=1
    python -m bench.traffic                               # the same, JSON to bench/results/traffic.json
    python -m bench.traffic --shapes deepseek --dtypes float32 --capacity-factors 0

Why bytes: most of what a layer does besides its expert GEMMs is bandwidth-bound on a GPU (row
gathers, the activation, the weighted combine and their backwards), so the bytes those ops move
predict their GPU time, and a CPU can count them exactly. One forward+backward runs under a
``TorchDispatchMode`` that sees every ATen op below autograd (what a GPU would launch, kernel
for kernel, on the path CUDA runs: the ``grouped_mm`` experts backend, forced here); for every
op that is not a GEMM it adds the bytes read and written (``op_bytes``), to the op's stage and
phase (forward or backward); the GEMMs of the expert FFN and of the router's logits are counted
apart (a batched product elsewhere, such as a combine's weighted sum written as ``bmm``, is
bandwidth work and counts). The figures are **passes over a ``[T*K, D]`` tensor of the model's
dtype** (bytes / ``T*K*D*itemsize``): independent of T, and in the unit of the rows every MoE
layer moves.

Stages (``bench.stage_profile.STAGES``: router, slots, dispatch, gemm, activation,
combine, losses; ``other`` for the rest), labelled from outside with ``stage_ranges``, the same
labels as the GPU profile. A forward op belongs to the innermost stage around it; a backward op
to the stage that created the autograd node running it (nodes are numbered in creation order,
so the stage whose forward created a node is the one whose range held the counter then), or to
a stage range opened inside that backward (the lean experts' activation helpers).

What an op moves (``op_bytes``): its tensor inputs are read and its outputs (and the inputs it
writes in place) written, each once, counting a tensor's distinct elements (a broadcast reads
its source once); views move nothing; a gather (``index_select``, ``gather``, ``index``,
``embedding``) reads the elements it picks, not its whole source; a scatter (``index_copy``,
``index_add``, ``scatter``, ``index_put``) writes (and for an add, reads) the elements it places;
``empty`` writes nothing, a fill writes its output.

The compulsory traffic (``compulsory``) is what an unfused layer must read and write at least
once per stage, with ``A = T*K`` routed rows (kept rows at cf > 0), ``F = 2H`` for a gated
activation (``F = H`` otherwise), the router in its own dtype:

    stage       forward                               backward
    router      logits [T,E] r, scores [T,E] w,       scores r, weights grad r, logits grad w
                weights+ids [T,K] w
    slots       ids [A] r, order+positions [A] w      -
    dispatch    x [T,D] r, rows [A,D] w               row grads [A,D] r, x grad [T,D] w
    activation  h [A,F] r, a [A,H] w                  a grad [A,H] r, h [A,F] r, h grad [A,F] w
    combine     y [A,D] r, weights [A] r,             out grad [T,D] r, y [A,D] r, y grad [A,D] w,
                out [T,D] w                           weights grad [A] w
    losses      probs [T,E] r (a sum per expert)      probs grad [T,E] w

(The GEMMs read and write their operands themselves: ``h``, ``y`` and the weights' traffic is
theirs.) ``A``: dropless, ``T*K``; at cf > 0, the rows of the capacity layout ``[E, C, D]``
that capacity mode is (GShard, Switch, Tutel: every expert computes ``C`` rows, the unfilled
ones zeros), ``E*C``; capped dropless (cf < 0), the kept rows. The report also gives the ratio
against the kept rows alone (``kept_ratio``), where padding would not count.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.gpu_kernels import Shape
from bench.stage_profile import STAGES, fwd_bwd, stage_ranges
from bench.common import RESULTS

__all__ = ["SHAPES", "TrafficShape", "op_bytes", "count_traffic", "compulsory", "traffic_report", "format_report", "main"]

OTHER = "other"
aten = torch.ops.aten

# GEMMs: in the expert and router stages their bytes are the GEMMs' own (counted apart, not in
# the totals); elsewhere (a batched product that is a K-term weighted sum) they count as traffic
GEMM_STAGES = frozenset({"gemm", "router"})
GEMMS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.addmm_.default, aten.baddbmm.default,
                   aten.baddbmm_.default, aten.addbmm.default, aten._grouped_mm.default, aten.mm.out, aten.bmm.out,
                   aten.addmm.out, aten.baddbmm.out})
GATHERS = frozenset({aten.index_select.default, aten.gather.default, aten.index.Tensor, aten.embedding.default,
                     aten.take_along_dim.default})
SCATTERS = frozenset({aten.index_copy.default, aten.index_copy_.default, aten.index_add.default,
                      aten.index_add_.default, aten.scatter.src, aten.scatter_.src, aten.scatter_add.default,
                      aten.scatter_add_.default, aten.index_put.default, aten.index_put_.default,
                      aten._index_put_impl_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two})
ACCUMULATING = frozenset({aten.index_add.default, aten.index_add_.default, aten.scatter_add.default,
                          aten.scatter_add_.default, aten.scatter_reduce.two, aten.scatter_reduce_.two})
NO_TRAFFIC = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                        aten.new_empty.default, aten.new_empty_strided.default, aten.detach.default,
                        aten.lift_fresh.default, aten._local_scalar_dense.default})


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a dimension of stride 0 counts once)."""
    if t.numel() == 0:
        return 0
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def _tensors(tree: object) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _written_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """The tensor arguments ``func`` writes in place (its schema's mutable aliases)."""
    out = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(_tensors(value))
    return out


def op_bytes(func, args: tuple, kwargs: dict, out: object) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """``(read, written)`` bytes of one ATen op (module docstring), 0 for views."""
    if func in NO_TRAFFIC or getattr(func, "is_view", False) or torch.Tag.view_copy in getattr(func, "tags", ()):
        return 0, 0
    outs = _tensors(out)
    written_args = _written_args(func, args, kwargs)
    inputs = _tensors((args, kwargs))
    if func in GATHERS:
        index = [t for t in inputs[1:] if not t.is_floating_point()]
        moved = sum(distinct_bytes(t) for t in outs)
        return moved + sum(distinct_bytes(t) for t in index), moved
    if func in SCATTERS:
        dest, rest = inputs[0], inputs[1:]
        placed = sum(distinct_bytes(t) for t in rest if t.is_floating_point() or t.dtype == dest.dtype)
        index = sum(distinct_bytes(t) for t in rest if not (t.is_floating_point() or t.dtype == dest.dtype))
        read = placed + index + (placed if func in ACCUMULATING else 0)
        copy = 0 if written_args else 2 * distinct_bytes(dest)  # out of place: the destination is copied first
        return read + copy // 2, placed + copy // 2
    seen: set[tuple[int, int]] = set()
    written = 0
    for t in [*written_args, *outs]:
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
        if key not in seen:
            seen.add(key)
            written += distinct_bytes(t)
    reads = 0
    for t in inputs:
        if func in (aten.fill_.Scalar, aten.zero_.default) and t is inputs[0]:
            continue  # a fill reads nothing of its destination
        reads += distinct_bytes(t)
    return reads, written


class _Counter(TorchDispatchMode):
    """Adds every op's bytes to ``(stage, phase)`` of ``self.bytes`` (GEMMs to ``self.gemm``)."""

    def __init__(self, stage_of) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.stage_of = stage_of
        self.bytes: dict[tuple[str, str], list[int]] = {}
        self.gemm = [0, 0]
        self.ops: dict[tuple[str, str, str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        read, written = op_bytes(func, args, kwargs, out)
        stage, phase = self.stage_of()
        if func in GEMMS and stage in GEMM_STAGES:
            self.gemm[0] += read
            self.gemm[1] += written
        elif read or written:
            slot = self.bytes.setdefault((stage, phase), [0, 0])
            slot[0] += read
            slot[1] += written
            name = str(func.overloadpacket.__name__)
            self.ops[stage, phase, name] = self.ops.get((stage, phase, name), 0) + read + written
        return out


class _Stages:
    """Which stage an op belongs to: the innermost open stage range; in backward, else the stage
    whose forward created the running autograd node (by the nodes' sequence numbers)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.starts: list[int] = [0]  # sequence numbers where the forward's stage changed ...
        self.names: list[str] = [OTHER]  # ... and the stage from there on

    @contextlib.contextmanager
    def label(self, stage: str) -> Iterator[None]:
        self._push(stage)
        try:
            yield
        finally:
            self._pop()

    def _mark(self) -> None:
        if torch._C._current_autograd_node() is None:  # the forward: remember where nodes of this stage start
            self.starts.append(torch._C._autograd._get_sequence_nr())
            self.names.append(self.stack[-1] if self.stack else OTHER)

    def _push(self, stage: str) -> None:
        self.stack.append(stage)
        self._mark()

    def _pop(self) -> None:
        self.stack.pop()
        self._mark()

    def __call__(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        phase = "fwd" if node is None else "bwd"
        if self.stack:
            return self.stack[-1], phase
        if node is None:
            return OTHER, phase
        i = bisect.bisect_right(self.starts, node._sequence_nr()) - 1
        return self.names[i], phase


def count_traffic(layer: torch.nn.Module, x: torch.Tensor, *, grad_out: torch.Tensor | None = None) -> dict:
    """Count one forward+backward of ``layer`` on ``x`` (``torch.autograd.grad`` of the output,
    with ``grad_out`` (default random), and of ``layer.aux_loss()``, to ``x`` and the
    parameters). Returns ``{"bytes": {(stage, phase): (read, written)}, "gemm": (read,
    written), "ops": {(stage, phase, op): bytes}}``. A warm-up call runs first (lazy
    initialisation and caches stay out of the count)."""
    g = torch.randn_like(x) if grad_out is None else grad_out
    fwd_bwd(layer, x, g)
    stages = _Stages()
    with stage_ranges(layer, stages.label), _Counter(stages) as counter:
        fwd_bwd(layer, x, g, lambda: stages.label("losses"))
    return {"bytes": {k: tuple(v) for k, v in counter.bytes.items()}, "gemm": tuple(counter.gemm), "ops": counter.ops}


# a layer shape for the count: the GPU benchmark's shapes, scaled down (T, and D and H together:
# passes depend on ``H/D``, ``K`` and, a little, ``E/D``)
TrafficShape = Shape

SHAPES = {
    # Mixtral-like: D=4096, H=14336 (H/D 3.5), E=8, K=2
    "mixtral": TrafficShape("mixtral", T=512, D=1024, H=3584, E=8, K=2),
    # DeepSeek-like: D=2048, H=1408 (H/D 0.6875), E=64, K=6
    "deepseek": TrafficShape("deepseek", T=512, D=512, H=352, E=64, K=6),
}


def compulsory(shape: TrafficShape, *, rows: int, itemsize: int, router_itemsize: int, gated: bool = True
               ) -> dict[tuple[str, str], int]:
    """The compulsory bytes per ``(stage, phase)`` of an unfused layer (module docstring's
    table); ``rows``: the routed rows the experts compute (``T*K`` dropless, the kept ones at
    cf > 0)."""
    T, D, H, E, K = shape.T, shape.D, shape.H, shape.E, shape.K
    A, F = rows, (2 * H if gated else H)
    r, m, i64 = router_itemsize, itemsize, 8
    return {
        ("router", "fwd"): T * E * r * 2 + T * K * (r + i64),
        ("router", "bwd"): T * E * r * 2 + T * K * r,
        ("slots", "fwd"): T * K * i64 + 2 * T * K * i64,
        ("dispatch", "fwd"): T * D * m + A * D * m,
        ("dispatch", "bwd"): A * D * m + T * D * m,
        ("activation", "fwd"): A * F * m + A * H * m,
        ("activation", "bwd"): A * H * m + 2 * A * F * m,
        ("combine", "fwd"): A * D * m + A * r + T * D * m,
        ("combine", "bwd"): T * D * m + 2 * A * D * m + A * r,
        ("losses", "fwd"): T * E * r,
        ("losses", "bwd"): T * E * r,
    }


def _layer(shape: TrafficShape, dtype: torch.dtype, cf: float):  # type: ignore[no-untyped-def]
    import moeflow

    torch.manual_seed(0)
    layer = moeflow.MoE(dim=shape.D, hidden=shape.H, num_experts=shape.E, top_k=shape.K, capacity_factor=cf,
                        dtype=dtype, experts=moeflow.ExpertsConfig(backend="grouped_mm"))
    return layer.train()


def traffic_report(shape: TrafficShape, dtype: torch.dtype, cf: float) -> dict:
    """Count the layer of ``shape`` (SwiGLU, the ``grouped_mm`` backend, training mode) in
    ``dtype`` at capacity factor ``cf``: per stage and phase, the counted and the compulsory
    passes over ``[T*K, D]`` of ``dtype``, and their totals."""
    from moeflow.dispatch.capacity import resolve_capacity

    layer = _layer(shape, dtype, cf)
    x = torch.randn(shape.T, shape.D, dtype=dtype, requires_grad=True)
    counted = count_traffic(layer, x)
    cap = resolve_capacity(cf, num_tokens=shape.T, top_k=shape.K, num_experts=shape.E)
    kept = int(layer.last_counts_E.clamp(max=cap.row_cap or shape.T * shape.K).sum())
    rows = shape.E * cap.layout_capacity if cap.layout_capacity is not None else kept
    itemsize = torch.empty((), dtype=dtype).element_size()
    router_itemsize = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    need = compulsory(shape, rows=rows, itemsize=itemsize, router_itemsize=router_itemsize)
    need_kept = compulsory(shape, rows=kept, itemsize=itemsize, router_itemsize=router_itemsize)
    unit = shape.T * shape.K * shape.D * itemsize
    rows_out = []
    for stage in (*STAGES, OTHER):
        for phase in ("fwd", "bwd"):
            got = sum(counted["bytes"].get((stage, phase), (0, 0)))
            base = need.get((stage, phase), 0)
            if got or base:
                rows_out.append({"stage": stage, "phase": phase, "passes": got / unit, "compulsory": base / unit})
    total = sum(r["passes"] for r in rows_out)
    floor = sum(r["compulsory"] for r in rows_out)
    floor_kept = sum(need_kept.values()) / unit
    top = sorted(counted["ops"].items(), key=lambda kv: -kv[1])[:12]
    return {"shape": vars(shape), "dtype": str(dtype).removeprefix("torch."), "capacity_factor": cf,
            "kept_rows": kept, "layout_rows": rows, "rows": rows_out, "passes": total, "compulsory": floor,
            "ratio": total / floor if floor else float("nan"), "kept_ratio": total / floor_kept,
            "gemm_passes": sum(counted["gemm"]) / unit,
            "top_ops": [{"stage": s, "phase": p, "op": o, "passes": b / unit} for (s, p, o), b in top]}


def format_report(r: dict) -> str:
    s = r["shape"]
    head = (f"{s['name']}-like T={s['T']} D={s['D']} H={s['H']} E={s['E']} K={s['K']}, {r['dtype']}, "
            f"cf={r['capacity_factor']:g}: {r['passes']:.1f} passes over [T*K, D], compulsory {r['compulsory']:.1f} "
            f"({r['ratio']:.2f}x" + (f"; {r['kept_ratio']:.2f}x of the kept rows' {r['kept_rows']}"
                                     if r["kept_rows"] != r["layout_rows"] else "")
            + f"); expert GEMMs {r['gemm_passes']:.1f} (apart)")
    lines = [head, f"  {'stage':<11} {'phase':<5} {'passes':>8} {'compulsory':>11}"]
    for row in r["rows"]:
        lines.append(f"  {row['stage']:<11} {row['phase']:<5} {row['passes']:>8.2f} {row['compulsory']:>11.2f}")
    lines.append("  largest: " + ", ".join(f"{o['stage']}/{o['phase']} {o['op']} {o['passes']:.1f}"
                                          for o in r["top_ops"][:6]))
    return "\n".join(lines)


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.traffic", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral,deepseek", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--capacity-factors", default="0,1")
    p.add_argument("--tokens", type=int, default=None, help="T (default: each shape's)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = default_json
    reports = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown {name!r}; shapes are {', '.join(sorted(SHAPES))}")
        shape = SHAPES[name]
        if args.tokens is not None:
            if args.tokens < 1:
                p.error(f"--tokens must be >= 1, got {args.tokens}")
            shape = TrafficShape(shape.name, args.tokens, shape.D, shape.H, shape.E, shape.K)
        for dt in args.dtypes.split(","):
            dtype = getattr(torch, dt, None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                p.error(f"--dtypes: {dt!r} is not a floating-point torch dtype")
            for cf in args.capacity_factors.split(","):
                r = traffic_report(shape, dtype, float(cf))
                print(format_report(r), flush=True)
                reports.append(r)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bench": "traffic", "reports": reports}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "traffic.json"))
