"""Starting a training run from the weights of another model (``LMTrainConfig.init_from``,
``moeflow train --init-from``): fine-tuning a Hugging Face model directory, a model converted
from one (``moeflow convert --from-hf``), or an earlier run's model under new settings.

``init_from`` names a moeflow checkpoint (a step directory, a checkpoint root, or a ``moeflow
train`` run directory: its latest complete checkpoint) or a Hugging Face model directory
(``config.json`` and no moeflow ``index.json``), of any family ``moeflow.convert.hf`` registers.
A Hugging Face directory is converted in memory, as ``moeflow convert --from-hf`` would convert
it, and never written as a separate checkpoint: the run's own checkpoints are moeflow
checkpoints, so ``resume`` and restarts continue from them and never read the directory's
weights again (``init_checkpoint`` reads its ``config.json`` and tokenizer files only).

What is taken from it and what is not, and why:

- the model config (every field, the context ``max_seq_len`` included): the weights only fit
  the model that wrote them, so a flag that would change the model is refused rather than
  silently ignored;
- the tokenizer: a moeflow checkpoint's (``moeflow train`` writes it; ``convert --from-hf``
  keeps the directory's ``tokenizer.json``), a Hugging Face directory's ``tokenizer.json``, with
  its end-of-sequence token as the end-of-document token. Only a model without one (a directory
  without ``tokenizer.json``) is trained on bytes, ids 0-255 of its vocabulary
  (``ByteTokenizer``; the vocabulary must hold 256 ids);
- what ``generate`` and ``convert --to-hf`` need of the original model (``carried_extra``): its
  tokenizer description as it came (the ``tokenizer.json`` text verbatim), its special token ids
  (every end-of-sequence id) and the Hugging Face family and kept files (chat template,
  generation config), which every checkpoint of the run carries on;
- not the optimizer state, the step or the RNG: the run is a new one (step 0, a fresh AdamW,
  its own warm-up) in its own ``out_dir``.

Under several ranks every rank builds the whole model from ``init_from`` before the experts are
spread (``train_lm``, ``init_model``), so any world size may start from any checkpoint. A Hugging
Face directory is read by every rank, not read by rank 0 and broadcast: each rank needs the
whole model before ``expert_parallel`` slices its experts out anyway, so a broadcast would add
the transfer and save no memory, while ranks reading the same files share them through the page
cache (``HFWeights`` memory-maps the safetensors files and reads one tensor at a time, copied
straight into the run's model in its dtype: no second copy of the model is made). The directory
must therefore be readable on every node, as a moeflow checkpoint given to ``init_from`` must.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch

from moeflow.checkpoint import CheckpointError, load_checkpoint
from moeflow.checkpoint.format import checkpoint_dir, latest_checkpoint, read_index
from moeflow.convert.hf import family_of
from moeflow.convert.hf_files import HFWeights, read_hf_config
from moeflow.convert.hf_model import model_from_weights
from moeflow.convert.hf_tokenizer import read_special_tokens, read_tokenizer
from moeflow.convert.quant import quantization_from_config
from moeflow.models import GPTConfig, MoEGPT

__all__ = ["init_checkpoint", "init_model", "carried_extra", "check_init_weights", "is_hf_dir", "MODEL_OVERRIDES"]

MODEL_FAMILY = "moeflow.MoEGPT"  # lm_checkpoint.MODEL_FAMILY (not imported: that module imports the config)

# LMTrainConfig fields that shape the model: with init_from the checkpoint decides them
MODEL_OVERRIDES = ("num_experts", "top_k", "capacity_factor", "moe_every", "load_balance_coef", "n_layers", "dim",
                   "n_heads", "expert_hidden")

# what a run's checkpoints carry on from the init_from model's extra (carried_extra)
_CARRIED = ("special_tokens", "hf")


def is_hf_dir(path: str | Path) -> bool:
    """``path`` is a Hugging Face model directory: it holds ``config.json`` and is no moeflow
    checkpoint (which holds ``index.json``)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and not (path / "index.json").exists()


def _stamp(path: Path) -> tuple:
    """The directory's regular files, with sizes and modification times (``_hf_extra``'s key)."""
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir()) if p.is_file())


@functools.lru_cache(maxsize=4)
def _hf_extra(path: str, stamp: tuple) -> dict:
    """What ``moeflow convert --from-hf`` would keep in the checkpoint's ``extra`` for the HF
    directory ``path``, read without its weights (``stamp``: the files it was read from)."""
    del stamp  # only the cache's key: a changed file reads anew
    config = read_hf_config(path)
    family = family_of(config.get("model_type"))
    model = family.config_from_hf(config)  # every field checked (a refused one names itself)
    tokens = read_special_tokens(path, config, model.vocab_size)
    tokenizer, files = read_tokenizer(path, tokens, model.vocab_size)
    return {"family": MODEL_FAMILY, "model": model.to_dict(), "tokenizer": tokenizer, "special_tokens": tokens,
            "hf": {"model_type": family.model_type, "files": files}, "source": path}


def init_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """The checkpoint directory ``path`` names (a step directory, a checkpoint root, a ``moeflow
    train`` run directory: its latest complete checkpoint; or a Hugging Face model directory,
    itself) and its ``extra`` (model config, tokenizer; for a Hugging Face directory what
    ``convert --from-hf`` keeps, its weights unread); ``ValueError`` naming ``init_from`` when it
    is none of these or not a MoE GPT checkpoint."""
    path = Path(path)
    try:
        if is_hf_dir(path):
            return path, copy.deepcopy(_hf_extra(str(path.resolve()), _stamp(path)))
        if not (path / "index.json").exists() and latest_checkpoint(path) is None:
            if latest_checkpoint(path / "checkpoints") is None:
                raise CheckpointError(f"no complete checkpoint here (nor under {path / 'checkpoints'}), and no "
                                      "config.json of a Hugging Face model directory")
            path = path / "checkpoints"
        path = checkpoint_dir(path)
        extra = read_index(path)["extra"]
    except (CheckpointError, OSError) as err:
        raise ValueError(f"init_from={str(path)!r}: {err}") from None
    if not isinstance(extra, dict) or extra.get("family") != MODEL_FAMILY or not isinstance(extra.get("model"), dict):
        family = extra.get("family") if isinstance(extra, dict) else None
        raise ValueError(f"init_from={str(path)!r}: not a MoE GPT checkpoint of moeflow train or moeflow convert "
                         f"--from-hf (family {family!r})")
    return path, extra


def check_init_weights(path: str | Path) -> None:
    """Before any work of a new run: a Hugging Face directory's weight files are all there and
    readable (every safetensors header, the shard index; no tensor is read). ``ValueError``
    naming ``init_from`` and the file. A moeflow checkpoint's files are checked when loaded."""
    if not is_hf_dir(path):
        return
    try:
        with HFWeights(path):
            pass
    except (CheckpointError, OSError) as err:
        raise ValueError(f"init_from={str(path)!r}: {err}") from None


def init_model(path: str | Path, config: GPTConfig, *, dtype: torch.dtype, device: torch.device | str) -> MoEGPT:
    """A ``MoEGPT`` of ``config`` (``init_checkpoint``'s model, with the run's own settings such
    as expert recompute) in ``dtype`` on ``device``, holding the weights of ``init_from``
    ``path``: a moeflow checkpoint's, or a Hugging Face directory's through its family's tensor
    map (dequantised where stored quantised; ``CheckpointError`` naming a missing or misshapen
    tensor before any is read)."""
    if not is_hf_dir(path):
        model = MoEGPT(config, device=device, dtype=dtype)
        load_checkpoint(init_checkpoint(path)[0], model, restore_rng=False)
        return model
    hf = read_hf_config(path)
    family = family_of(hf.get("model_type"))
    quant = quantization_from_config(hf.get("quantization_config"))
    with HFWeights(path) as weights:
        model = model_from_weights(weights, family, config, quant, dtype=dtype, where=path,
                                   left_out=family.left_out(hf))
    return model.to(device)


def carried_extra(init: dict | None) -> dict:
    """What every checkpoint of a run started from ``init`` (``init_checkpoint``'s extra; None:
    a run from scratch) keeps of it: the special token ids and the Hugging Face family and files,
    and its tokenizer description as it came (the run's tokenizer is that one, so
    ``convert --to-hf`` writes the original ``tokenizer.json`` back byte for byte)."""
    if init is None:
        return {}
    out = {k: init[k] for k in _CARRIED if init.get(k) is not None}
    return out if init.get("tokenizer") is None else {**out, "tokenizer": init["tokenizer"]}
