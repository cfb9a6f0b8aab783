"""Starting a training run from the weights of another checkpoint (``LMTrainConfig.init_from``,
``moeflow train --init-from``): fine-tuning a converted model (``moeflow convert --from-hf``) or
continuing an earlier run's model under new settings.

What is taken from the checkpoint and what is not, and why:

- the model config (every field, the context ``max_seq_len`` included): the weights only fit
  the model that wrote them, so a flag that would change the model is refused rather than
  silently ignored;
- the tokenizer, when the checkpoint has one (``moeflow train`` writes it); a converted model
  has none (its tokenizer lives with the Hugging Face files), so the run trains it on bytes,
  ids 0-255 of its vocabulary (``ByteTokenizer``; the vocabulary must hold 256 ids): a
  starting point for the pipeline, not a use of the original tokenizer;
- not the optimizer state, the step or the RNG: the run is a new one (step 0, a fresh AdamW,
  its own warm-up) in its own ``out_dir``.

Under several ranks every rank loads the whole model before the experts are spread
(``train_lm``), so any world size may start from any checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from moeflow.checkpoint import CheckpointError
from moeflow.checkpoint.format import checkpoint_dir, latest_checkpoint, read_index

__all__ = ["init_checkpoint", "MODEL_OVERRIDES"]

MODEL_FAMILY = "moeflow.MoEGPT"  # lm_checkpoint.MODEL_FAMILY (not imported: that module imports the config)

# LMTrainConfig fields that shape the model: with init_from the checkpoint decides them
MODEL_OVERRIDES = ("num_experts", "top_k", "capacity_factor", "moe_every", "load_balance_coef", "n_layers", "dim",
                   "n_heads", "expert_hidden")


def init_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """The checkpoint directory ``path`` names (a step directory, a checkpoint root, or a
    ``moeflow train`` run directory: its latest complete checkpoint) and its ``extra`` (model
    config, tokenizer, dtype); ``ValueError`` naming ``init_from`` when it is none of these or
    not a MoE GPT checkpoint."""
    path = Path(path)
    try:
        if not (path / "index.json").exists() and latest_checkpoint(path) is None:
            if latest_checkpoint(path / "checkpoints") is None:
                raise CheckpointError(f"no complete checkpoint here (nor under {path / 'checkpoints'})")
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
