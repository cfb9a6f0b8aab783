"""What a ``moeflow train`` checkpoint holds besides the weights, and reading it back.

``train_lm`` saves under ``out_dir/checkpoints`` with the ``extra`` of ``checkpoint_extra``:
the model family, the model config, the parameter dtype, the tokenizer and the training config
(plus the history so far). Both readers rely on it: ``resume`` continues a run and refuses one
whose model config or data settings (which decide the batch each step sees) differ, and
``build_from_checkpoint`` rebuilds the model and tokenizer on one process for sampling or
conversion. Writer and readers of ``extra`` live here together so they cannot drift apart.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeflow.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_index
from moeflow.models import GPTConfig, MoEGPT
from moeflow.parallel.comm import ProcessGroup
from moeflow.train.data import Tokenizer, tokenizer_from_dict
from moeflow.train.lm_config import LMTrainConfig

__all__ = ["MODEL_FAMILY", "build_from_checkpoint", "checkpoint_extra", "resume"]

MODEL_FAMILY = "moeflow.MoEGPT"

# these decide which data each step sees: a resumed run must keep them
_DATA_SETTINGS = ("batch_size", "grad_accum", "seq_len", "seed", "tokenizer", "bpe_vocab", "val_works")


def checkpoint_extra(cfg: LMTrainConfig, model_cfg: GPTConfig, tok: Tokenizer) -> dict:
    """The ``extra`` every checkpoint of this run stores (``train_lm`` adds ``"history"``)."""
    return {"family": MODEL_FAMILY, "model": model_cfg.to_dict(), "dtype": cfg.dtype, "tokenizer": tok.to_dict(),
            "train": cfg.to_dict()}


def resume(root: Path, cfg: LMTrainConfig, model_cfg: GPTConfig, model: MoEGPT, opt: torch.optim.Optimizer,
           group: ProcessGroup | None) -> dict | None:
    """Load the latest complete checkpoint under ``root`` into ``model`` and ``opt`` (every rank
    of ``group`` calls it); ``load_checkpoint``'s info, or None when there is none yet. Raises
    ``ValueError`` when it was written with another model config or other data settings."""
    if latest_checkpoint(root) is None:
        return None
    info = load_checkpoint(root, model, opt, group=group)
    if info["extra"].get("model") != model_cfg.to_dict():
        raise ValueError(f"{info['path']}: checkpoint model config differs from this run's; use another out_dir")
    saved = info["extra"].get("train", {})
    changed = {k: (saved.get(k), v) for k, v in cfg.to_dict().items() if k in _DATA_SETTINGS and saved.get(k) != v}
    if changed:
        raise ValueError(f"{info['path']}: resuming with other data settings (saved, now): {changed}")
    return info


def build_from_checkpoint(path: str | Path, *, device: str = "cpu") -> tuple[MoEGPT, Tokenizer | None, dict]:
    """Rebuild the model and tokenizer a ``moeflow train`` (or ``moeflow convert --from-hf``)
    checkpoint was written with and load its weights (one process, whatever world size wrote
    it). Returns ``(model, tokenizer, info)``; the tokenizer is ``None`` for a converted model,
    whose tokenizer lives with the Hugging Face files."""
    path = Path(path)
    if not (path / "index.json").exists():
        found = latest_checkpoint(path) or latest_checkpoint(path / "checkpoints")
        if found is None:
            raise CheckpointError(f"{path}: no complete checkpoint here (nor under {path / 'checkpoints'})")
        path = found
    extra = read_index(path).get("extra", {})
    if extra.get("family") != MODEL_FAMILY:
        raise CheckpointError(
            f"{path}: not a {MODEL_FAMILY} checkpoint (family {extra.get('family')!r}); "
            "it was not written by `moeflow train`"
        )
    try:
        model_cfg = GPTConfig.from_dict(extra["model"])
        tok = tokenizer_from_dict(extra["tokenizer"]) if extra.get("tokenizer") is not None else None
        dtype = getattr(torch, extra.get("dtype", "float32"))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {extra.get('dtype')!r} is not a torch dtype")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}/index.json: corrupt model or tokenizer description: {err}") from err
    model = MoEGPT(model_cfg, device=device, dtype=dtype)
    info = load_checkpoint(path, model, restore_rng=False)
    model.eval()
    return model, tok, info
