"""Where one forward+backward of a ``moeflow.MoE`` layer spends its time, stage by stage.

    result = profile_stages(layer, x)          # one profiled fwd+bwd after a warm-up
    print(format_stage_table(result))

Stages (``STAGES``), each with its forward and its backward time:

    router      the router module: logits, scores, top-k (and the selection bias)
    slots       slot assignment (``moeflow.dispatch.slots.assign_slots``: sort by expert, positions)
    dispatch    the rest of the dispatch: plan, capacity, the gather of the rows to their experts
    gemm        the expert FFN module: its grouped GEMMs and their bookkeeping (offsets)
    activation  the expert activation and its backward, where it runs as ops of its own (the Triton
                backend fuses it into the GEMM epilogues: then it is counted under ``gemm``)
    combine     the gather back to the tokens and the weighted sum of each token's K rows
    losses      the router's balance losses (and the sum ``layer.aux_loss()``)
    other       whatever runs outside those (input checks, reshapes, the shared experts, the
                autograd engine's own ops), so that the rows add up to the total

**How ops are attributed, without touching the layer's hot path.** Only for the duration of the
profiled call (``stage_ranges``), the stages are labelled from outside with
``torch.profiler.record_function`` ranges: forward pre/post hooks on ``layer.router`` and
``layer.experts``; the local dispatcher's ``dispatch`` and ``combine`` methods replaced on the
instance by wrappers; the module-level functions the layer calls by name (``assign_slots`` in
``moeflow.dispatch.local``, the activation helpers of ``moeflow.experts.lean`` and
``moeflow.experts.ffn``, the loss functions in ``moeflow.layer.router``) replaced by wrappers.
Everything is restored on exit, so a layer that is not being profiled runs unchanged.

A forward op belongs to the innermost stage range around it. A backward op runs inside the
autograd engine's ``autograd::engine::evaluate_function: <Node>`` event; the node carries the
sequence number of the forward op that created it (``FunctionEvent.sequence_nr``, with the
forward thread ``fwd_thread``), so the backward op belongs to that forward op's stage, unless a
stage range opened inside the node's backward is closer (the lean experts' backward calls the
same, wrapped, activation helpers: those ops are ``activation`` backward). Among the forward
ops that share the node's sequence number (ops that create no node, e.g. integer ops, do not
advance it), the creator is the one whose name matches the node (``MmBackward0`` <-
``aten::mm``, ``_FirstGEMMBackward`` <- ``_FirstGEMM``), else the last one started.

Times: on CUDA each op's own device time (``self_device_time_total``: the kernels it launched,
directly), on CPU its own CPU time (``self_cpu_time_total``). Every op of the profiled call
counts once, so the rows add up to ``total_ms``; on CUDA, kernels the profiler could not link to
an op are reported apart (``unlinked_kernel_ms``).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["STAGES", "LABEL", "stage_ranges", "profiler_label", "attribute_events", "profile_stages",
           "format_stage_table"]

STAGES = ("router", "slots", "dispatch", "gemm", "activation", "combine", "losses")
LABEL = "moeflow_stage::"  # prefix of the record_function ranges
_BACKWARD = "autograd::engine::evaluate_function: "
_OTHER = "other"


Label = Callable[[str], contextlib.AbstractContextManager]


def profiler_label(stage: str) -> contextlib.AbstractContextManager:
    """The default ``stage_ranges`` label: a ``record_function`` range named ``LABEL + stage``."""
    return record_function(LABEL + stage)


def _wrap(fn: Callable, stage: str, label: Label) -> Callable:
    @functools.wraps(fn)
    def labelled(*args: object, **kwargs: object) -> object:
        with label(stage):
            return fn(*args, **kwargs)

    return labelled


def _module_functions() -> list[tuple[object, str, str]]:
    """``(module, attribute, stage)`` of the functions the layer calls by module-level name."""
    import moeflow.dispatch.local as local
    import moeflow.experts.ffn as ffn
    import moeflow.experts.lean as lean
    import moeflow.layer.router as router

    found = [(local, "assign_slots", "slots"), (lean, "_activate", "activation"),
             (lean, "_act_backward_", "activation"), (ffn, "activate", "activation")]
    found += [(router, name, "losses") for name in
              ("load_balance_loss", "importance_loss", "load_loss", "router_z_loss", "smooth_load_E")]
    return [(mod, name, stage) for mod, name, stage in found if callable(getattr(mod, name, None))]


@contextlib.contextmanager
def stage_ranges(layer: torch.nn.Module, label: Label = profiler_label) -> Iterator[None]:
    """Label ``layer``'s stages inside the block, from outside (module docstring): every stage
    runs inside ``label(stage)`` (default: ``record_function`` ranges named ``LABEL + stage``;
    ``bench.traffic`` passes its own); everything is put back on exit."""
    undo: list[Callable[[], None]] = []
    try:
        for mod, name, stage in _module_functions():
            original = getattr(mod, name)
            setattr(mod, name, _wrap(original, stage, label))
            undo.append(lambda mod=mod, name=name, original=original: setattr(mod, name, original))
        dispatcher = layer.dispatcher
        for method, stage in (("dispatch", "dispatch"), ("combine", "combine")):
            if not callable(getattr(dispatcher, method, None)):
                continue  # a dispatcher without the local stages (expert parallel): under "other"
            had = method in vars(dispatcher)
            previous = vars(dispatcher).get(method)
            setattr(dispatcher, method, _wrap(getattr(dispatcher, method), stage, label))
            undo.append(lambda d=dispatcher, m=method, had=had, prev=previous:
                        setattr(d, m, prev) if had else delattr(d, m))
        for module, stage in ((layer.router, "router"), (layer.experts, "gemm")):
            open_ranges: list[contextlib.AbstractContextManager] = []

            def enter(_mod: object, _args: object, stage: str = stage, open_ranges: list = open_ranges) -> None:
                rf = label(stage)
                rf.__enter__()
                open_ranges.append(rf)

            def leave(_mod: object, _args: object, _out: object, open_ranges: list = open_ranges) -> None:
                open_ranges.pop().__exit__(None, None, None)

            undo.append(module.register_forward_pre_hook(enter).remove)
            undo.append(module.register_forward_hook(leave).remove)
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _norm(name: str) -> str:
    """Comparable op / node name: ``aten::_to_copy`` and ``ToCopyBackward0`` -> ``tocopy``."""
    name = name.removeprefix("aten::").removeprefix(_BACKWARD)
    name = re.sub(r"Backward\d*$", "", name)
    return name.replace("_", "").lower()


def _chain(ev) -> Iterator:  # type: ignore[no-untyped-def]
    while ev is not None:
        yield ev
        ev = ev.cpu_parent


def _stage_and_node(ev):  # type: ignore[no-untyped-def]
    """``(innermost stage range at or above ev, the evaluate_function event above ev)``, where the
    stage counts only if it is closer than the evaluate_function event (None where absent)."""
    stage = node = None
    for up in _chain(ev):
        if up.name.startswith(_BACKWARD):
            node = up
            break
        if stage is None and up.name.startswith(LABEL):
            stage = up.name[len(LABEL):]
    return stage, node


def attribute_events(events) -> list[tuple[object, str, str]]:  # type: ignore[no-untyped-def]
    """``(event, stage, phase)`` for every CPU-side op event of a profile (``prof.events()``):
    ``stage`` one of ``STAGES`` or ``"other"``, ``phase`` ``"fwd"`` or ``"bwd"`` (module
    docstring: ranges for forward ops, sequence numbers for backward ones)."""
    cpu = [ev for ev in events if ev.device_type == DeviceType.CPU and not ev.is_async]
    placed = {id(ev): _stage_and_node(ev) for ev in cpu}
    creators: dict[tuple[int, int], list] = {}
    for ev in cpu:
        if ev.sequence_nr >= 0 and placed[id(ev)][1] is None:  # a forward op
            creators.setdefault((ev.thread, ev.sequence_nr), []).append(ev)

    def creator_stage(node) -> str:  # type: ignore[no-untyped-def]
        found = creators.get((node.fwd_thread, node.sequence_nr), [])
        if not found:
            return _OTHER
        named = [ev for ev in found if _norm(ev.name) == _norm(node.name)]
        ev = max(named or found, key=lambda e: e.time_range.start)
        return placed[id(ev)][0] or _OTHER

    out = []
    for ev in cpu:
        stage, node = placed[id(ev)]
        if node is None:
            out.append((ev, stage or _OTHER, "fwd"))
        else:
            out.append((ev, stage or creator_stage(node), "bwd"))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor,
            losses_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """One forward+backward of ``layer`` on ``x``: ``torch.autograd.grad`` of the output (with
    gradient ``g``) and of ``layer.aux_loss()`` (computed inside ``losses_scope()``, gradient 1)
    to ``x`` (when it requires grad) and the parameters; nothing accumulates into ``.grad``."""
    inputs = ([x] if x.requires_grad else []) + [p for p in layer.parameters() if p.requires_grad]
    y = layer(x)
    with losses_scope():
        aux = layer.aux_loss()
    outs, grads = [y], [g]
    if aux.requires_grad:
        outs.append(aux)
        grads.append(torch.ones_like(aux))
    torch.autograd.grad(outs, inputs, grads, allow_unused=True)


def profile_stages(layer: torch.nn.Module, x: torch.Tensor, *, grad_out: torch.Tensor | None = None, warmup: int = 1,
                   steps: int = 1, trace_path: str | Path | None = None, keep_events: bool = False) -> dict:
    """Profile ``steps`` forward+backward passes of ``layer`` on ``x`` (after ``warmup``
    unprofiled ones) and split the time of one (the mean) by stage (module docstring).

    The backward is ``torch.autograd.grad`` of the output (with ``grad_out``, default random) and
    of ``layer.aux_loss()`` to ``x`` (when it requires grad) and the parameters: nothing
    accumulates into ``.grad``. Returns ``{"unit": "device" | "cpu", "device", "total_ms",
    "rows": [{"stage", "fwd_ms", "bwd_ms", "ms", "share"}] (STAGES then "other"),
    "unlinked_kernel_ms", "steps"}`` and, with ``keep_events``, ``"events": [{"name", "stage",
    "phase", "us"}]`` (``us`` divided by ``steps`` too). ``trace_path``: also export the Chrome
    trace there."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    device = x.device
    g = torch.randn_like(x) if grad_out is None else grad_out

    def step() -> None:
        fwd_bwd(layer, x, g, lambda: record_function(LABEL + "losses"))

    for _ in range(warmup):
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities):  # a first, discarded session pays the profiler's start-up
        step()
        _sync(device)
    with stage_ranges(layer), profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    events = prof.events()
    on_device = device.type == "cuda"
    attributed = attribute_events(events)
    per: dict[tuple[str, str], float] = {}
    kept = []
    for ev, stage, phase in attributed:
        us = (ev.self_device_time_total if on_device else ev.self_cpu_time_total) / steps
        per[stage, phase] = per.get((stage, phase), 0.0) + us
        if keep_events:
            kept.append({"name": ev.name, "stage": stage, "phase": phase, "us": us})
    total = sum(per.values())
    rows = []
    for stage in (*STAGES, _OTHER):
        fwd, bwd = per.get((stage, "fwd"), 0.0) / 1e3, per.get((stage, "bwd"), 0.0) / 1e3
        rows.append({"stage": stage, "fwd_ms": fwd, "bwd_ms": bwd, "ms": fwd + bwd,
                     "share": (fwd + bwd) / (total / 1e3) if total else 0.0})
    unlinked = 0.0
    if on_device:
        kernels = sum(ev.device_time_total for ev in events if ev.device_type != DeviceType.CPU and not ev.is_async
                      and not ev.is_user_annotation and not ev.name.startswith(LABEL))
        unlinked = max(0.0, kernels / steps - total) / 1e3
    result = {"unit": "device" if on_device else "cpu", "device": str(device), "total_ms": total / 1e3,
              "rows": rows, "unlinked_kernel_ms": unlinked, "steps": steps}
    if keep_events:
        result["events"] = kept
    return result


def format_stage_table(result: dict) -> str:
    """The rows of ``profile_stages`` as a plain-text table."""
    unit = "device kernel" if result["unit"] == "device" else "CPU op"
    unit += f" time, mean of {result['steps']} fwd+bwd" if result.get("steps", 1) > 1 else " time"
    head = f"{'stage':<11} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} {'share':>7}"
    lines = [f"{head}   ({unit}, {result['device']})"]
    for r in result["rows"]:
        lines.append(f"{r['stage']:<11} {r['fwd_ms']:>9.3f} {r['bwd_ms']:>9.3f} {r['ms']:>9.3f} {r['share']:>7.1%}")
    lines.append(f"{'total':<11} {'':>9} {'':>9} {result['total_ms']:>9.3f} {1:>7.1%}")
    if result.get("unlinked_kernel_ms"):
        lines.append(f"(kernels the profiler linked to no op: {result['unlinked_kernel_ms']:.3f} ms, not in the rows)")
    return "\n".join(lines)
