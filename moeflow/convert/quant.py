"""Quantised weights of published checkpoints, dequantised at load (never kept quantised).

``config.json``'s ``quantization_config`` names the format (``quantization_from_config``); any
other ``quant_method`` is refused by name. A ``Quantization`` knows which stored tensors hold a
logical tensor (``stored``), checks their shapes and dtypes against the shape the tensor map
expects (``check``), and turns them into float32 values (``dequantize``):

- ``fp8`` (DeepSeek-V3): a linear weight ``X.weight [O, I]`` in ``float8_e4m3fn`` beside
  ``X.weight_scale_inv [ceil(O/bo), ceil(I/bi)]`` (float32), one scale per ``bo x bi`` block
  (``weight_block_size``, 128 x 128 published); the last blocks of a dimension that ``bo``/``bi``
  do not divide are short. ``w = float(fp8) * scale_inv`` of its block.
- ``mxfp4`` (gpt-oss): a fused expert tensor ``X [E, I, O]`` stored as ``X_blocks [E, O, I/32,
  16]`` (uint8, two e2m1 values per byte: the low nibble is the even element, the high nibble the
  odd one) and ``X_scales [E, O, I/32]`` (uint8, e8m0: the block of 32 values is scaled by
  ``2**(s - 127)``), the blocks running along ``I``; dequantised ``[E, O, I]``, then transposed to
  ``[E, I, O]``, as transformers' ``convert_moe_packed_tensors`` gives it.

The dequantisation is exact in float32: an fp8 value times a float32 scale is one correctly
rounded product, an e2m1 value times a power of two is representable. The loader then casts to
the model's dtype once (a bfloat16 model rounds each weight once, where dequantising in
bfloat16 would round the scale and the product).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from moeflow.checkpoint.schema import CheckpointError

__all__ = ["FP4_E2M1", "BlockFP8", "MXFP4", "Quantization", "fp8_block_dequantize", "mxfp4_dequantize",
           "quantization_from_config"]

# the 16 e2m1 values by code: sign bit 3, exponent bits 2-1, mantissa bit 0 (OCP MX spec)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
Shape = tuple[int, ...]


def fp8_block_dequantize(weight_OI: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """float32 ``weight * scale_inv`` of its ``block[0] x block[1]`` block (edge blocks short)."""
    O, I = weight_OI.shape
    scale_OI = scale_inv.float().repeat_interleave(block[0], dim=0)[:O].repeat_interleave(block[1], dim=1)[:, :I]
    return weight_OI.float() * scale_OI


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values ``[..., G*32]`` of MXFP4 ``blocks [..., G, 16]`` (uint8) and ``scales
    [..., G]`` (uint8 e8m0): byte ``j`` of a block holds element ``2j`` in its low nibble and
    ``2j + 1`` in its high nibble; the block's values are scaled by ``2**(scale - 127)``."""
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).flatten(-2)


class Quantization(Protocol):
    """A storage format: which stored tensors hold a logical one (``stored``, given every stored
    name; None: not quantised), their checks against the logical ``shape`` (``found``: each
    stored tensor's shape and dtype), and the float32 values (``dequantize``)."""

    method: str

    def stored(self, name: str, names: set[str]) -> tuple[str, ...] | None: ...

    def check(self, name: str, found: dict[str, tuple[Shape, torch.dtype | str]], shape: Shape) -> None: ...

    def dequantize(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor: ...


def _refuse(name: str, what: str, got: object, want: object) -> None:
    raise CheckpointError(f"quantised tensor {name}: {what} {got}, expected {want}")


class BlockFP8:
    """DeepSeek-V3's block-wise fp8 (module docstring)."""

    method = "fp8"

    def __init__(self, block: Sequence[int]) -> None:
        self.block = (int(block[0]), int(block[1]))

    def stored(self, name: str, names: set[str]) -> tuple[str, ...] | None:
        scale = f"{name}_scale_inv"
        return (name, scale) if name.endswith(".weight") and name in names and scale in names else None

    def check(self, name: str, found: dict[str, tuple[Shape, torch.dtype | str]], shape: Shape) -> None:
        (w_shape, w_dtype), (s_shape, s_dtype) = found[name], found[f"{name}_scale_inv"]
        if w_dtype != torch.float8_e4m3fn:
            _refuse(name, "dtype", w_dtype, "float8_e4m3fn (fmt e4m3)")
        if len(shape) != 2 or w_shape != tuple(shape):
            _refuse(name, "shape", w_shape, f"{tuple(shape)} (config.json gives it; fp8 holds 2-D linear weights)")
        want = tuple(math.ceil(n / b) for n, b in zip(shape, self.block))
        if s_shape != want:
            _refuse(f"{name}_scale_inv", "shape", s_shape, f"{want} (one scale per {self.block} block)")
        if s_dtype != torch.float32:
            _refuse(f"{name}_scale_inv", "dtype", s_dtype, "float32")

    def dequantize(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return fp8_block_dequantize(tensors[0], tensors[1], self.block)


class MXFP4:
    """gpt-oss's MXFP4 fused experts (module docstring)."""

    method = "mxfp4"

    def stored(self, name: str, names: set[str]) -> tuple[str, ...] | None:
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        return (blocks, scales) if blocks in names and scales in names and name not in names else None

    def check(self, name: str, found: dict[str, tuple[Shape, torch.dtype | str]], shape: Shape) -> None:
        (b_shape, b_dtype), (s_shape, s_dtype) = found[f"{name}_blocks"], found[f"{name}_scales"]
        for part, dtype in ((f"{name}_blocks", b_dtype), (f"{name}_scales", s_dtype)):
            if dtype != torch.uint8:
                _refuse(part, "dtype", dtype, "uint8")
        if len(shape) < 2 or shape[-2] % 32:
            _refuse(name, "unquantised shape", tuple(shape), "[..., I, O] with I a multiple of 32 (config.json gives it)")
        *lead, I, O = shape
        if b_shape != (*lead, O, I // 32, 16):
            _refuse(f"{name}_blocks", "shape", b_shape, (*lead, O, I // 32, 16))
        if s_shape != (*lead, O, I // 32):
            _refuse(f"{name}_scales", "shape", s_shape, (*lead, O, I // 32))

    def dequantize(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        blocks, scales = tensors
        if bool((scales == 255).any()):  # e8m0's NaN
            raise CheckpointError("an MXFP4 scale is 255, which e8m0 reserves for NaN")
        return mxfp4_dequantize(blocks, scales).transpose(-1, -2).contiguous()


def quantization_from_config(qc: object) -> Quantization | None:
    """The ``Quantization`` of ``config.json``'s ``quantization_config`` (None: not quantised);
    ``CheckpointError`` naming the field for a method, format or option moeflow does not read."""
    if qc is None:
        return None
    where = "config.json: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}={qc!r:.60} is not a JSON object")
    method = qc.get("quant_method")
    known = {"fp8": {"quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt", "dequantize",
                     "modules_to_not_convert", "expert_dtype"},
             "mxfp4": {"quant_method", "modules_to_not_convert", "dequantize"}}
    if method not in known:
        raise CheckpointError(f"{where}.quant_method={method!r:.40} is not supported; moeflow dequantises "
                              f"{sorted(known)} at load")
    unknown = sorted(set(qc) - known[method])
    if unknown:
        raise CheckpointError(f"{where}: field(s) {unknown} not understood for quant_method {method!r}")
    skip = qc.get("modules_to_not_convert")  # which modules stayed unquantised: the files say so too
    if skip is not None and not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise CheckpointError(f"{where}.modules_to_not_convert={skip!r:.60} is not a list of names")
    if method == "mxfp4":
        return MXFP4()
    checks = {"fmt": ("e4m3", None), "activation_scheme": ("dynamic", None), "scale_fmt": ("float", None),
              "expert_dtype": ("fp8", None)}
    for field, allowed in checks.items():
        if qc.get(field) not in allowed:
            raise CheckpointError(f"{where}.{field}={qc[field]!r:.40} is not supported (moeflow reads "
                                  f"{allowed[0]!r})")
    block = qc.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise CheckpointError(f"{where}.weight_block_size={block!r:.40} is not two ints >= 1")
    return BlockFP8(block)
