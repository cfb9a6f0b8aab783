"""A ``MoEGPT`` from one family's Hugging Face directory, and back, through the family's tensor
map (``moeflow.convert.tensor_map``). Which family a directory is, is ``moeflow.convert.hf``'s
business; everything here takes the ``Family``.

Loading (``load_hf``) checks everything before reading a tensor: ``config.json`` through the
family's ``config_from_hf`` (every field mapped or refused), the storage format
(``quantization_config``, ``moeflow.convert.quant``), then, from the safetensors headers alone,
that every tensor the map expects is there (in one of its layouts) with the shape the config
gives it and a floating-point dtype (or its quantised form), and that no stored tensor is left
over (an unknown tensor is refused by name: it may be a feature the map does not express). Only
then is the model built and filled, one entry at a time (a tensor, or an expert stack, in memory
at once). Buffers the map does not fill (the router's balancing statistics) start fresh.

Writing (``save_hf``) refuses what the family's checkpoint cannot hold (``hf_config_from``'s
checks; a parameter outside the map; a nonzero ``router.expert_bias``, which changes which
experts are chosen), then writes each entry's first layout, shard by shard.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.family import Family
from moeflow.convert.hf_files import DEFAULT_SHARD_SIZE, HFWeights, read_hf_config, write_hf
from moeflow.convert.hf_tokenizer import check_special_tokens, tokenizer_output
from moeflow.convert.quant import Quantization, quantization_from_config
from moeflow.convert.tensor_map import Entry, Layout, hf_shapes
from moeflow.models.gpt import GPTConfig, MoEGPT

__all__ = ["load_hf", "save_hf", "model_from_weights", "state_dict_from_tensors", "state_dict_to_tensors", "DictWeights"]

_IGNORED_TENSORS = (".rotary_emb.inv_freq",)  # RoPE's table, which older checkpoints saved: recomputed
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DictWeights:
    """In-memory tensors (a transformers model's ``state_dict()``) with ``HFWeights``' interface."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.names = set(tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class _Source:
    """The stored tensors under the names the map uses: plain, or dequantised by ``quant``."""

    def __init__(self, weights: HFWeights | DictWeights, quant: Quantization | None, where: object) -> None:
        self.weights, self.quant, self.where = weights, quant, where
        self.names = weights.names

    def stored(self, name: str) -> tuple[str, ...] | None:
        if self.quant is not None and (parts := self.quant.stored(name, self.names)) is not None:
            return parts
        return (name,) if name in self.names else None

    def check(self, name: str, shape: tuple[int, ...], ours: str) -> None:
        """``name`` (present) has ``shape`` and a floating-point dtype, or its quantised form
        fits ``shape``."""
        parts = self.stored(name)
        if self.quant is not None and parts != (name,):
            self.quant.check(name, {p: (self.weights.shape(p), self.weights.dtype(p)) for p in parts}, shape)
            return
        got = self.weights.shape(name)
        if got != shape:
            raise CheckpointError(f"{self.where}: tensor {name!r} (for {ours}) has shape {got}, config.json gives {shape}")
        if self.weights.dtype(name) not in _FLOATS:
            hint = "" if self.quant else "; a quantised checkpoint names its format in config.json's quantization_config"
            raise CheckpointError(f"{self.where}: tensor {name!r} (for {ours}) is {self.weights.dtype(name)}, expected a "
                                  f"floating-point dtype (float16, bfloat16, float32 or float64){hint}")

    def read(self, name: str) -> torch.Tensor:
        parts = self.stored(name) or (name,)
        tensors = [self.weights.read(p) for p in parts]
        return self.quant.dequantize(tensors) if self.quant is not None and parts != (name,) else tensors[0]


def _plan(family: Family, cfg: GPTConfig, source: _Source, left_out: dict[str, str] | None = None
          ) -> list[tuple[Entry, Layout | None]]:
    """Each entry with the layout it is read from (None: a tied entry the checkpoint omits),
    after checking every expected tensor's presence, shape and dtype and that none is left but
    those under a ``left_out`` prefix (the family's, for this checkpoint), which are warned
    about."""
    with torch.device("meta"):  # the shapes cfg gives, without memory
        meta = MoEGPT(cfg)
    want = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    entries = family.tensor_map(cfg)
    unmapped = sorted({name for name, _ in meta.named_parameters()} - {e.ours for e in entries})
    if unmapped:
        raise RuntimeError(f"the {family.name} tensor map has no entry for {unmapped[:5]}")
    plan: list[tuple[Entry, Layout | None]] = []
    used: set[str] = set()
    for entry in entries:
        layout = next((lay for lay in entry.layouts if all(source.stored(n) for n in lay.hf)), None)
        if layout is None and entry.tied_to is None:
            missing = [n for n in entry.layouts[0].hf if not source.stored(n)]
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{source.where}: HF checkpoint has no tensor {missing[0]!r}{more}, which "
                                  f"{entry.ours} is made of")
        if layout is not None:
            for name, shape in hf_shapes(layout, want[entry.ours]).items():
                source.check(name, shape, entry.ours)
                used.update(source.stored(name) or ())
        plan.append((entry, layout))
    unknown = sorted(n for n in source.names - used if not n.endswith(_IGNORED_TENSORS))
    for prefix, why in (left_out or {}).items():
        skipped = [n for n in unknown if n.startswith(prefix)]
        if skipped:
            warnings.warn(f"{source.where}: {len(skipped)} tensor(s) under {prefix}* are not loaded: {why}",
                          stacklevel=3)
            unknown = [n for n in unknown if not n.startswith(prefix)]
    if unknown:
        raise CheckpointError(f"{source.where}: HF checkpoint has tensors the {family.name} mapping does not know: "
                              f"{unknown[:5]}" + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    return plan


def _model_dtype(plan: list[tuple[Entry, Layout | None]], source: _Source) -> torch.dtype:
    """The stored dtype of the embedding (float32 where it is quantised)."""
    for entry, layout in plan:
        if entry.ours == "embed.weight" and layout is not None and source.stored(layout.hf[0]) == (layout.hf[0],):
            dtype = source.weights.dtype(layout.hf[0])
            return dtype if isinstance(dtype, torch.dtype) else torch.float32
    return torch.float32


def model_from_weights(weights: HFWeights | DictWeights, family: Family, cfg: GPTConfig,
                       quant: Quantization | None = None, *, dtype: torch.dtype | None = None,
                       where: object = "HF checkpoint", left_out: dict[str, str] | None = None) -> MoEGPT:
    """A ``MoEGPT`` of ``cfg`` filled from ``weights`` through ``family``'s map (module docstring);
    ``left_out``: ``family.left_out(config.json)``, the stored tensors it leaves out on purpose."""
    source = _Source(weights, quant, where)
    plan = _plan(family, cfg, source, left_out)
    model = MoEGPT(cfg, dtype=dtype or _model_dtype(plan, source))
    state = model.state_dict()
    with torch.no_grad():
        for entry, layout in plan:
            if layout is None:
                continue
            value = layout.load([source.read(n) for n in layout.hf])
            if entry.tied_to is not None:  # held anyway: it must be the tensor it is tied to
                if not torch.equal(value.to(state[entry.tied_to].dtype), state[entry.tied_to]):
                    raise CheckpointError(f"{where}: {layout.hf} differ from {entry.tied_to}, to which config.json "
                                          "ties them")
                continue
            state[entry.ours].copy_(value)
    return model


def load_hf(path: str | os.PathLike, family: Family, *, dtype: torch.dtype | None = None) -> MoEGPT:
    """A ``MoEGPT`` holding the weights of ``family``'s model directory ``path`` (dequantised
    where stored quantised), in ``dtype`` (default: the embedding's stored dtype)."""
    hf = read_hf_config(path)
    if hf.get("model_type") != family.model_type:
        raise CheckpointError(f"{path}/config.json: model_type {hf.get('model_type')!r:.60} is not "
                              f"{family.model_type!r} ({family.name})")
    cfg = family.config_from_hf(hf)  # every field checked before a tensor is read
    quant = quantization_from_config(hf.get("quantization_config"))
    with HFWeights(path) as weights:
        return model_from_weights(weights, family, cfg, quant, dtype=dtype, where=path, left_out=family.left_out(hf))


def state_dict_from_tensors(tensors: dict[str, torch.Tensor], family: Family, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """HF tensors (in memory) -> ``MoEGPT.state_dict()`` names, every tensor accounted for (a
    tied entry names the tensor it is tied to, as ``MoEGPT.state_dict()`` does)."""
    source = _Source(DictWeights(tensors), None, "HF state dict")
    out: dict[str, torch.Tensor] = {}
    for entry, layout in _plan(family, cfg, source):
        value = None if layout is None else layout.load([source.read(n) for n in layout.hf])
        if entry.tied_to is not None:
            if value is not None and not torch.equal(value, out[entry.tied_to]):
                raise CheckpointError(f"HF state dict: {layout.hf} differ from {entry.tied_to}, to which the config "
                                      "ties them")
            value = out[entry.tied_to]
        out[entry.ours] = value
    return out


def state_dict_to_tensors(sd: dict[str, torch.Tensor], family: Family, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """``MoEGPT.state_dict()`` -> the family's on-disk tensors (each entry's first layout)."""
    out: dict[str, torch.Tensor] = {}
    for entry in family.tensor_map(cfg):
        if entry.tied_to is None:
            out.update(zip(entry.layouts[0].hf, entry.layouts[0].save(sd[entry.ours])))
    return out


def _check_exportable(model: MoEGPT, family: Family, entries: list[Entry]) -> None:
    mapped = {e.ours for e in entries}
    params = {name for name, _ in model.named_parameters()}
    for name, value in model.state_dict().items():
        if name in mapped or name.endswith("router.load_counts"):  # (balancing statistics, not the model)
            continue
        if name.endswith("router.expert_bias"):
            if bool(value.ne(0).any()):
                raise ValueError(f"cannot export to {family.name}: {name} is nonzero (aux-loss-free balancing changes "
                                 f"which experts are chosen, and {family.name}'s router has no such bias)")
        elif name in params:
            raise ValueError(f"cannot export to {family.name}: {name} has no place in its checkpoint")


def save_hf(model: MoEGPT, path: str | os.PathLike, family: Family, *, special_tokens: dict | None = None,
            tokenizer: dict | None = None, files: dict | None = None,
            max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write ``model`` as ``family``'s model directory: ``config.json`` (with ``special_tokens``,
    the bos/eos/pad ids, ``None`` by default), the weights (sharded past ``max_shard_size``),
    ``generation_config.json`` and the tokenizer files (``hf_tokenizer.tokenizer_output``:
    ``tokenizer``, a moeflow tokenizer description, and ``files`` kept from an HF directory)."""
    if not isinstance(model, MoEGPT):
        raise TypeError(f"model must be a MoEGPT, got {type(model).__name__}")
    cfg = model.config
    config = family.hf_config_from(cfg)
    entries = family.tensor_map(cfg)
    _check_exportable(model, family, entries)
    tokens = check_special_tokens(special_tokens or {}, cfg.vocab_size, "special_tokens")
    extra_files = tokenizer_output(tokenizer, files, tokens, cfg.vocab_size, cfg.max_seq_len)
    state = model.state_dict()
    config.update(tokens, dtype=str(state["embed.weight"].dtype).removeprefix("torch."))
    groups = []
    for entry in entries:
        if entry.tied_to is not None:
            continue
        layout, t = entry.layouts[0], state[entry.ours].detach()
        sizes = {n: math.prod(s) * t.element_size() for n, s in hf_shapes(layout, t.shape).items()}
        groups.append((sizes, lambda layout=layout, t=t: dict(zip(layout.hf, (x.cpu() for x in layout.save(t))))))
    out = write_hf(path, config, groups, max_shard_size=max_shard_size)
    for name, text in extra_files.items():
        (out / name).write_text(text, encoding="utf-8")
    return out
