"""Triton kernels for the MoE hot path, each beside the torch reference it must match
(legend: moeflow.types).

- the row-moving primitive of permute (dispatch gather) and unpermute (weighted combine), and
  of their backwards: ``launch_gather_reduce`` and ``launch_gather_dot``; references
  ``moeflow.kernels.permute.gather_reduce_reference`` and ``gather_dot_reference``. The
  differentiable ops that run them on CUDA (``permute_rows``, ``unpermute_rows``) live in
  ``moeflow.kernels.permute``, which runs on any device.
- slot assignment: ``assign_positions``; references ``assign_positions_reference`` (Tutel's
  one-hot cumsum) and ``moeflow.dispatch.assign_slots`` (compared in the tests)
- fused routing: ``fused_topk_routing``; reference ``moeflow.routing.select_experts``
- grouped GEMM: ``grouped_mm_triton``; reference ``moeflow.kernels.grouped_mm_loop``
- grouped expert FFN, activation fused: ``grouped_ffn_triton``; reference
  ``moeflow.experts.ffn.grouped_ffn``

(``kernels/`` is a leaf: the references that live in ``routing/``, ``dispatch/`` and
``experts/`` are named here and compared in ``tests/test_kernels_triton.py``, never imported.)

Every differentiable entry point is a ``torch.library`` custom op (namespace ``moeflow``) with
a fake (meta) implementation and a registered backward, so ``torch.compile(fullgraph=True)``
traces through it without a graph break.

Where the kernels run (``triton_available``): on CUDA tensors when Triton is importable, and on
CPU tensors only when Triton's *interpreter* is active, i.e. the process set
``TRITON_INTERPRET=1`` before importing Triton (the tests do this). The library itself never
reads that variable: it asks Triton (``triton.knobs.runtime.interpret``). Triton fixes the
mode of a kernel when its module is first imported, so switch the interpreter on before
anything imports ``moeflow.kernels.triton``'s kernel modules, and leave it on.

Importing this package does not import Triton; the kernels' modules are loaded on first use.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from functools import lru_cache
from typing import Any

import torch

__all__ = [
    "triton_importable",
    "interpreter_active",
    "triton_available",
    "check_triton_tensors",
    "device_guard",
    # lazily loaded (they import triton)
    "launch_gather_reduce",
    "launch_gather_dot",
    "assign_positions",
    "assign_positions_reference",
    "fused_topk_routing",
    "grouped_mm_triton",
    "grouped_ffn_triton",
    "TRITON_ACTIVATIONS",
]

_LAZY = {
    "launch_gather_reduce": "permute",
    "launch_gather_dot": "permute",
    "assign_positions": "slots",
    "assign_positions_reference": "slots",
    "fused_topk_routing": "routing",
    "grouped_mm_triton": "grouped_gemm",
    "grouped_ffn_triton": "grouped_gemm",
    "TRITON_ACTIVATIONS": "grouped_gemm",
}


@lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the ``triton`` package is installed (found without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` was set
    before Triton read its settings). Imports Triton; False when it is not installed."""
    if not triton_importable():
        return False
    import triton.knobs

    return bool(triton.knobs.runtime.interpret)


def _constant_under_compile(fn):
    """Mark ``fn`` as returning a constant for ``torch.compile`` (Dynamo calls it at trace time
    instead of tracing it). This is exactly what ``torch.compiler.assume_constant_result`` does,
    but that helper imports ``torch._dynamo``, which imports Triton, at *our* import time."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_compile
def triton_available(device: torch.device | str) -> bool:
    """Can the Triton kernels run on tensors of ``device``?

    CUDA: yes when Triton is importable. CPU: only under the Triton interpreter (slow; meant
    for tests at tiny sizes). Any other device: no. Under ``torch.compile`` the answer is taken
    once at trace time as a constant (it asks the environment, which Dynamo cannot trace).
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return triton_importable() and torch.cuda.is_available()
    if kind == "cpu":
        return interpreter_active()
    return False


def check_triton_tensors(op: str, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the op and argument when a tensor is on a device the
    kernels cannot run on (see ``triton_available``)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not triton_available(t.device):
            why = (
                "CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before importing triton)"
                if t.device.type == "cpu"
                else "Triton kernels run on CUDA (or CPU under the Triton interpreter)"
            )
            raise ValueError(f"{op}: {name} is on device {t.device}, where the Triton kernels cannot run: {why}")


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(t.device)`` for a CUDA tensor (Triton launches on the *current*
    device, which need not be ``t``'s), a no-op context otherwise."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
