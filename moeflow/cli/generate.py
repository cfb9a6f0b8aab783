"""``moeflow generate``: sample text from a ``moeflow train`` checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_generate", "sample"]


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a `moeflow train` checkpoint",
                       description="Rebuild the model and tokenizer of a `moeflow train` checkpoint (any world size "
                       "that wrote it) and sample a continuation of --prompt.")
    p.add_argument("checkpoint", type=Path, help="a checkpoint directory, a checkpoints root, or a train --out directory")
    p.add_argument("--prompt", default="ROMEO.\n")
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from moeflow.checkpoint import CheckpointError

    try:
        print(sample(str(args.checkpoint), args.prompt.replace("\\n", "\n"), args.tokens, args.temperature,
                     args.top_k or None, args.seed))
    except (CheckpointError, ValueError, TypeError) as err:
        print(f"moeflow generate: error: {err}", file=sys.stderr)
        return 2
    return 0


def sample(checkpoint: str, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    """``prompt`` and ``tokens`` sampled tokens after it, from the model and tokenizer of a ``moeflow
    train`` checkpoint (``ValueError`` when it has no tokenizer, e.g. one converted from Mixtral)."""
    import torch

    from moeflow.train import build_from_checkpoint

    model, tok, _ = build_from_checkpoint(checkpoint)
    if tok is None:
        raise ValueError(f"{checkpoint}: the checkpoint has no tokenizer (converted from Hugging Face); "
                         "sample with transformers' tokenizer instead")
    ids = tok.encode(prompt) or [0]
    out = model.generate(torch.tensor([ids]), tokens, temperature=temperature, top_k=top_k,
                         generator=torch.Generator().manual_seed(seed))
    return tok.decode(out[0].tolist())
