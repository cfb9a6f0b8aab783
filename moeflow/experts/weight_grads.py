"""Expert weight gradients ``dW[e] = x_e^T g_e`` for the lean FFN (``moeflow.experts.lean``):
returned as a new tensor, written into a slice, or **added into the weight's existing
``.grad``** (legend: moeflow.types; ``like``/``out``: ``[E, D, F]``).

Why the last one (gradient accumulation fusion, as Megatron-Core's
``gradient_accumulation_fusion``): from the second micro-batch of gradient accumulation on,
every expert weight already has a ``.grad``. Autograd's way is to allocate the micro-batch's
gradient, one ``[E, ...]`` tensor per weight, and add it into ``.grad`` (``AccumulateGrad``'s
in-place ``+=``): for one MoE layer that transient is as large as the layer's expert
parameters (384 MiB at T=4096, D=1024, H=2048, E=16), more than its activations. Added in place
(``baddbmm_`` / ``addmm_`` per expert, or a grouped GEMM over about 1/8 of the experts at a
time), the backward allocates none of it.

``grad_buffer`` decides, in backward (``.grad`` may change between forward and backward), and
takes the fused way only when it gives what autograd would (to rounding: ``baddbmm_`` adds
inside the GEMM):

- the weight's gradient edge goes to its ``AccumulateGrad`` node (the parameter itself, not a
  cast or a slice of it; read from the node, so the parameter is found also when the saved
  weight is a detached copy: non-reentrant ``torch.utils.checkpoint``, saved-tensor hooks) and
  its ``.grad`` is a dense tensor of its shape, dtype and device that autograd will accumulate
  into in this backward (``backward()``, not ``autograd.grad()`` nor ``backward(inputs=...)``
  without it);
- no tensor hook is registered on the weight (a hook sees and may change the micro-batch's
  gradient, which the fused way never makes);
- the backward records no graph (``create_graph=True``: autograd then makes a new ``.grad``,
  leaving the old tensor as it was; ``records_grad_mode`` notes the mode before
  ``once_differentiable`` turns it off).

Otherwise the gradient is computed as a new tensor and autograd adds it. When fused, the
Function returns a zero tensor (``torch._efficientzerotensor``: no memory) for the weight:
``AccumulateGrad`` still runs and adds nothing, so post-accumulate-grad hooks see the summed
gradient. Two differences stay, neither visible to a training loop: hooks registered on
autograd *nodes* (a pre-hook on the weight's ``AccumulateGrad`` node, or a hook on the lean
node; torch offers no way to see them) get the zero tensor, and if the backward fails after a
lean node ran, ``.grad`` already holds that node's part (as it holds every parameter's whose
``AccumulateGrad`` ran before the failure). The tests compare fused and autograd accumulation
(fp64, every layout and activation, with and without recompute) and check each condition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["add_grouped_chunks_", "add_weight_grad_", "expert_row_ranges", "grad_buffer", "mm_weight_grad",
           "no_grad_to_add", "records_grad_mode", "weight_grad_into", "zero_grad_"]

_GROUPS = 8  # grouped_mm adds: about 1/_GROUPS of the experts per temporary


def records_grad_mode(backward):
    """Decorates a Function's ``backward`` (outside ``once_differentiable``) to note in
    ``ctx.graph_recorded`` whether the backward records a graph (``create_graph``)."""

    # the decorator runs at import, before mutmut picks a mutant: not mutated (``_note_grad_mode``
    # is, and a broken wrapper fails every lean backward test)
    def wrapped(ctx, *grads):
        _note_grad_mode(ctx)  # pragma: no mutate
        return backward(ctx, *grads)  # pragma: no mutate

    return wrapped


def _note_grad_mode(ctx) -> None:
    """Sets ``ctx.graph_recorded``: whether the running backward records a graph. A function of
    its own, called in backward, so that coverage tools (mutation testing's too) see the tests
    that reach it; the decorator itself runs only at import."""
    ctx.graph_recorded = torch.is_grad_enabled()


def grad_buffer(ctx, edge: int, w: torch.Tensor) -> torch.Tensor | None:
    """The ``.grad`` of the parameter behind ``w`` if this backward may add ``w``'s gradient into
    it in place (module docstring), else None. ``edge``: ``w``'s position among the Function's
    tensor arguments (its index in ``ctx.next_functions``), which is also its index in
    ``ctx.needs_input_grad`` when the tensor arguments come first. The backward must be
    decorated with ``records_grad_mode``."""
    if not ctx.needs_input_grad[edge] or getattr(ctx, "graph_recorded", True):
        return None
    node = ctx.next_functions[edge][0]
    param = getattr(node, "variable", None)  # only an AccumulateGrad node has one
    if param is None or param._backward_hooks:
        return None
    param.moeflow_adds_grad = True  # zero_grad_ keeps its .grad from step to step (it is worth keeping)
    g = param.grad
    if (g is None or g.layout != torch.strided or g.shape != w.shape or g.dtype != w.dtype
            or g.device != w.device or g.requires_grad or g._is_zerotensor()):
        return None
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return None
    try:
        return g if will_execute(node) else None
    except RuntimeError:  # autograd.grad(): the caller takes the gradient, .grad is not touched
        return None


def no_grad_to_add(w: torch.Tensor) -> torch.Tensor:
    """What a Function returns for a weight whose gradient it already added into ``.grad``:
    a zero tensor that allocates nothing, for ``AccumulateGrad`` to add."""
    return torch._efficientzerotensor(w.shape, dtype=w.dtype, device=w.device)


def mm_weight_grad(gemm: str, x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor | None,
                   like: torch.Tensor) -> torch.Tensor:
    """``dW[e] = x_e^T g_e``, a new tensor shaped like ``like`` (``[E, D, F]``)."""
    if gemm == "bmm":
        return torch.bmm(x.transpose(1, 2), g)
    if gemm == "grouped_mm":
        if like.stride(-2) == 1 and not like.is_contiguous():
            # like is the transposed view of an [E, F, D] tensor: produce dW in that layout
            return F.grouped_mm(g.t(), x, offs=offs).transpose(-2, -1)
        return F.grouped_mm(x.t(), g, offs=offs)
    dw = like.new_empty(like.shape)
    weight_grad_into("loop", x, g, offs, dw)
    return dw


def weight_grad_into(gemm: str, x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor | None,
                     out: torch.Tensor) -> None:
    """``out[e] = x_e^T g_e`` in place (``out``: e.g. a slice ``[e0:e1]`` of the whole gradient)."""
    if gemm == "bmm" and out.is_contiguous():
        torch.bmm(x.transpose(1, 2), g, out=out)
    elif gemm == "loop":
        for e, (s, t) in enumerate(expert_row_ranges(offs)):
            if t > s:
                torch.mm(x[s:t].t(), g[s:t], out=out[e])
            else:
                out[e].zero_()
    else:
        out.copy_(mm_weight_grad(gemm, x, g, offs, out))


def add_weight_grad_(gemm: str, x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor | None,
                     out: torch.Tensor) -> None:
    """``out[e] += x_e^T g_e`` in place: ``baddbmm_`` (``"bmm"``), each expert's ``addmm_``
    (``"loop"``, and ``"grouped_mm"`` on the CPU, where ``F.grouped_mm`` is itself a loop of
    products: adding inside each GEMM allocates nothing, where a grouped temporary would be
    fresh pages from the kernel at every call and one more pass over them), else grouped GEMMs
    over about 1/8 of the experts at a time (``add_grouped_chunks_``)."""
    if gemm == "bmm":
        out.baddbmm_(x.transpose(1, 2), g)
        return
    if gemm == "loop" or out.device.type == "cpu":
        for e, (s, t) in enumerate(expert_row_ranges(offs)):
            if t > s:
                out[e].addmm_(x[s:t].t(), g[s:t])
        return
    add_grouped_chunks_(x, g, offs, out)


def add_grouped_chunks_(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor, out: torch.Tensor) -> None:
    """``out[e] += x_e^T g_e`` by grouped GEMMs over ``ceil(E / 8)`` experts at a time, each
    product a temporary of about 1/8 of ``out`` added into it (a chunk without rows is skipped:
    a 0-row grouped GEMM is not run)."""
    ranges = expert_row_ranges(offs)
    E = len(ranges)
    step = max(1, -(-E // _GROUPS))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        r0, r1 = ranges[e0][0], ranges[e1 - 1][1]
        if r1 > r0:  # experts without rows add nothing (and a 0-row grouped GEMM is not run)
            offs_c = offs[e0:e1] - r0
            out[e0:e1].add_(F.grouped_mm(x[r0:r1].t(), g[r0:r1], offs=offs_c))


def zero_grad_(module: nn.Module) -> None:
    """Ready ``module``'s gradients for the next step, as ``module.zero_grad()`` does, but keep
    the buffers worth keeping: the ``.grad`` on the CPU of every parameter whose gradient a
    backward of this module adds in place (marked ``moeflow_adds_grad`` by ``grad_buffer``: the
    lean experts' weights) is zeroed in place; every other ``.grad`` is dropped (``None``).

    Why: dropped, an expert weight's gradient is a new tensor at every step, as large as the
    layer's experts (1.5 GiB a layer for OLMoE's 64 experts in fp32). On the CPU that is new
    pages from the kernel at every step, which the weight-gradient GEMMs fault in: kept, the
    step's backward adds into memory it already holds (``add_weight_grad_``), and a zeroing
    pass replaces the faults. The cost is that memory held through the next forward too (as
    Megatron-Core's gradient buffers and DDP's bucket views hold theirs). On a GPU, where the
    caching allocator hands a step's gradients memory it already holds, keeping them would only
    cost that memory and one more pass (the grouped additions, ``add_grouped_chunks_``): they are
    dropped there. A parameter's ``.grad`` is kept only while it is a plain dense tensor (not
    sparse, not a zero tensor); the other gradients are dropped exactly as
    ``zero_grad(set_to_none=True)`` drops them (an optimizer then skips a parameter that gets no
    new gradient, as before). A kept one is detached and zeroed as ``zero_grad`` would."""
    for p in module.parameters():
        g = p.grad
        if g is None:
            continue
        if (getattr(p, "moeflow_adds_grad", False) and g.device.type == "cpu" and g.layout == torch.strided
                and not g._is_zerotensor()):
            if g.grad_fn is not None:
                g.detach_()
            else:
                g.requires_grad_(False)
            g.zero_()
        else:
            p.grad = None


def expert_row_ranges(offs: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` rows of each expert from inclusive cumulative counts (one host sync)."""
    ends = [int(v) for v in offs.tolist()]
    return list(zip([0] + ends[:-1], ends))
