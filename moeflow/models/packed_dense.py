"""The dense products of a CPU compiled decode step over packed weights: the projections
(``PackedCPULinear``, a stand-in for a plain ``nn.Linear``) and the head (``HeadProduct``)
(legend: ``R`` rows, ``K`` input features, ``N`` output features, ``V`` vocabulary, ``D`` model
width).

Why: a decode step multiplies a few rows by every projection and the head, whose weights come
from memory. The BLAS runs a product of a few rows (more than one) far below the memory's rate,
and a one-row product on one thread only (``docs/benchmarks.md``); the few-row kernel of
``moeflow.kernels.packed_cpu`` streams each weight once, on every thread, over a packed copy
(``pack_weight`` of ``W^T`` as one "expert": ``[1, S, K, 16]``). The same kernel and the same
reasons as the packed experts (``moeflow.experts.packed``), for the products that are not
experts'. The copy costs each weight's memory once more while a generation runs.

A ``PackedCPULinear`` sends to its linear the calls the kernel is not for: more than
``MAX_DENSE_ROWS`` rows (a long prompt's prefill, where a BLAS's blocking can win), calls in
grad mode and under autocast. Under ``torch.compile`` its product is one opaque op
(``moeflow::packed_linear``). The readable reference is ``F.linear`` (the tests compare outputs,
equal up to rounding: the products sum in another order).
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.kernels.packed_cpu import copy_into, pack_into, packed_cpu_available, packed_grouped_mm

__all__ = ["MAX_DENSE_ROWS", "packable_linear", "PackedCPULinear", "HeadProduct", "packed_linear"]

# more rows than this go to the linear itself: a prefill's products are no longer few-row ones
MAX_DENSE_ROWS = 128


def packable_linear(module: object) -> bool:
    """The one rule for which modules a ``PackedCPULinear`` stands in for: a plain ``nn.Linear``
    (exactly: a subclass may compute something else) with fp32 CPU weight and bias."""
    if type(module) is not nn.Linear:
        return False
    params = [module.weight] + ([] if module.bias is None else [module.bias])
    return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)


def packed_linear(x_RK: torch.Tensor, packed: torch.Tensor, bias_N: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x W^T + b`` (``[R, n]``) over ``packed`` (``pack_weight(W^T[None])``); under
    ``torch.compile`` one opaque op."""
    if torch.compiler.is_compiling():
        return _packed_linear_op(x_RK, packed, bias_N, n)
    return _packed_linear(x_RK, packed, bias_N, n)


def _packed_linear(x_RK: torch.Tensor, packed: torch.Tensor, bias_N: torch.Tensor | None, n: int) -> torch.Tensor:
    counts_1 = torch.full((1,), x_RK.shape[0], dtype=torch.long, device=x_RK.device)
    return packed_grouped_mm(x_RK, packed, counts_1, n, None if bias_N is None else bias_N.unsqueeze(0))


@torch.library.custom_op("moeflow::packed_linear", mutates_args=())
def _packed_linear_op(x_RK: torch.Tensor, packed: torch.Tensor, bias_N: torch.Tensor | None, n: int) -> torch.Tensor:
    return _packed_linear(x_RK, packed, bias_N, n)


@_packed_linear_op.register_fake
def _(x_RK, packed, bias_N, n):  # type: ignore[no-untyped-def]
    return x_RK.new_empty((x_RK.shape[0], n))


def _pack(weight_NK: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """A linear's weight ``[N, K]`` packed as one expert's ``W^T``, into ``old`` where it fits."""
    return pack_into(weight_NK.detach().t().unsqueeze(0), old)


class PackedCPULinear(nn.Module):
    """A decode-only stand-in for ``linear`` (``packable_linear``): its product over a packed copy
    of the weight (``packed [1, S, K, 16]``) and a copy of the bias (buffers that are not saved),
    the linear itself for the calls the kernel is not for (module docstring). The linear is held
    without being a submodule (``source``: the model's parameters are not counted twice);
    ``weight`` and ``bias`` are the linear's, for code that reads them. ``repack`` packs again
    from the weights as they are, into the same memory where the shapes allow (what lets a
    compiled step that read these buffers run on the new values)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("bias_copy", None, persistent=False)
        self.repack(linear)

    @property
    def weight(self) -> torch.Tensor:
        return self.source.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.source.bias

    def repack(self, linear: nn.Linear) -> None:
        """Stand in for ``linear`` (``packable_linear``) from now on, packed from its weights as
        they are now."""
        if not packable_linear(linear):
            raise ValueError(f"linear must be a plain nn.Linear with fp32 CPU weights (moeflow.models.packed_dense."
                             f"packable_linear), got {type(linear).__name__}")
        self.packed = _pack(linear.weight, self.packed)
        self.bias_copy = copy_into(linear.bias, self.bias_copy)
        object.__setattr__(self, "source", linear)  # (not a submodule: see the class docstring)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, self.in_features)
        if (rows == 0 or rows > MAX_DENSE_ROWS or x.dtype != torch.float32
                or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)):
            return self.source(x)
        y_RN = packed_linear(x.reshape(rows, self.in_features), self.packed, self.bias_copy, self.out_features)
        return y_RN.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packs of {type(self.source).__name__}"


class HeadProduct:
    """The output projection of the CPU's compiled decode step: logits ``[B, V]`` of the normed
    hidden states ``h [B, D]`` by the head's weight ``W [V, D]``, in one layout for every batch
    size, chosen by a fixed rule (never by timing it), so the logits depend on the inputs alone
    (layouts sum in different orders, and a layout picked by a clock could make greedy tokens
    depend on the machine's load): an fp32 weight is packed and multiplied by the few-row kernel
    (module docstring; where the kernel does not build, and for other dtypes, a contiguous ``[D,
    V]`` copy and a BLAS product). ``begin`` takes the copy from the weight as it is (so the
    product follows the weight through training between calls): the head's memory once more
    while a generation runs; ``end`` drops it."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self.weight_DV: torch.Tensor | None = None
        self.weight_VD: torch.Tensor | None = None  # the head's own weight (packed: not a copy)

    def begin(self, weight_VD: torch.Tensor) -> None:
        """Before a generation: the copy of the head's weight as it is now."""
        self.end()
        if weight_VD.dtype == torch.float32 and weight_VD.device.type == "cpu" and packed_cpu_available():
            self.packed, self.weight_VD = _pack(weight_VD, None), weight_VD
        else:
            self.weight_DV = weight_VD.detach().t().contiguous()

    def end(self) -> None:
        """After a generation: drop the copy."""
        self.packed = self.weight_DV = self.weight_VD = None

    def __call__(self, h_BD: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of ``h [B, D]`` (between ``begin`` and ``end``; a packed fp32 head
        given other states multiplies them by its weight through ``F.linear``)."""
        if self.packed is not None:
            if h_BD.dtype != torch.float32:
                return torch.nn.functional.linear(h_BD, self.weight_VD.to(h_BD.dtype))
            return _packed_linear(h_BD, self.packed, None, self.weight_VD.shape[0])
        if self.weight_DV is None:
            raise RuntimeError("HeadProduct.begin comes first: it takes the head's weight")
        return h_BD @ self.weight_DV
