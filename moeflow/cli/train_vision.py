"""``moeflow train-vision``: the vision MoE on scikit-learn's digits (``moeflow.train.vision``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moeflow.cli.errors import UsageError, error_line
from moeflow.cli.flags import check_output_dir, config_from_flags, env_threads, int_at_least, threads_help

__all__ = ["add_train_vision"]


def add_train_vision(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-vision", help="train the vision MoE on scikit-learn's digits and report test accuracy",
                       description="Train a ViT with MoE MLP blocks (V-MoE / SwinV2-MoE style) on the 1,797 8x8 "
                       "handwritten digits of scikit-learn, 25% held out for the test accuracy.")
    p.add_argument("--epochs", type=int, default=15, help="passes over the training digits")
    p.add_argument("--batch-size", type=int, default=64, help="images per step")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (AdamW)")
    p.add_argument("--experts", dest="num_experts", type=int, default=8, help="experts per MoE block (E)")
    p.add_argument("--top-k", type=int, default=2, help="the router's k: experts per token")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="slots per expert over the even share (tokens past it are dropped)")
    p.add_argument("--router", default="linear", choices=["linear", "cosine"], help="router scoring")
    p.add_argument("--drop-policy", default="position", choices=["position", "score", "bpr"],
                   help="which tokens an over-full expert drops")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data split and order")
    p.add_argument("--threads", type=int_at_least(1), default=None, help=threads_help(2))
    p.add_argument("--out", dest="out_dir", type=Path, default=None,
                   help="write the final checkpoint, history.json and training.png (loss, test loss, learning "
                   "rate, expert load per epoch) here (default: nothing is written)")
    p.add_argument("--overwrite", action="store_true", help="replace what an earlier train-vision run wrote in --out")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (a line per epoch instead; also when not on a terminal)")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="with --out: do not write training.png")
    p.set_defaults(func=_run_train_vision)


_WRITES = ("checkpoints", "history.json", "training.png")


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` can be written and holds no earlier run unless ``--overwrite`` (then that run's
    files are removed before training)."""
    import shutil

    if args.out_dir is None:
        if args.overwrite:
            raise UsageError("--overwrite goes with --out DIR")
        return
    check_output_dir("--out", args.out_dir)
    found = [name for name in _WRITES if (args.out_dir / name).exists()]
    if found and not args.overwrite:
        raise UsageError(f"--out {args.out_dir}: holds an earlier run ({', '.join(found)}); pass --overwrite to "
                         "replace it, or another --out")
    for name in found:
        path = args.out_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _run_train_vision(args: argparse.Namespace) -> int:
    import torch

    from moeflow.train.nonfinite import NonFiniteLossError
    from moeflow.train.vision import VisionTrainConfig, train_vision

    cfg = config_from_flags(VisionTrainConfig, args, prog="moeflow train-vision")
    if cfg is None:
        return 2
    _check_out(args)
    torch.set_num_threads(args.threads or env_threads() or 2)
    try:
        result = train_vision(cfg)
    except NonFiniteLossError as err:
        print(error_line("moeflow train-vision", err), file=sys.stderr)
        return 1
    print(f"test accuracy: {result['test_accuracy']:.4f} on {result['test_images']} held-out digits "
          f"(before training {result['test_accuracy_before']:.4f}; {result['seconds']:.1f} s)")
    for what in ("checkpoint", "plot"):
        if what in result:
            print(f"wrote {result[what]}")
    return 0
