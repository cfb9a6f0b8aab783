"""``moeflow train`` (the MoE GPT on Shakespeare, one process or N expert-parallel ranks) and
``moeflow train-vision`` (the vision MoE on scikit-learn's digits)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from moeflow.cli.flags import config_from_flags
from moeflow.cli.generate import sample

__all__ = ["add_train", "add_train_vision"]


def add_train(sub: argparse._SubParsersAction) -> None:
    from moeflow.models import GPT_PRESETS
    from moeflow.train.data import DEFAULT_VAL_WORKS

    p = sub.add_parser(
        "train",
        help="train the MoE GPT on the Shakespeare corpus (one process or N expert-parallel ranks)",
        description="Train moeflow's MoE GPT language model on the 42 works of the `shakespeare` package, "
        "holding out whole works for validation. Prints the validation loss before and after, writes "
        "checkpoints, history.json and training.png (loss curves + per-layer expert load) under --out, "
        "and prints a sample from the final checkpoint. --out holds one run: a new run into a directory "
        "that holds another is refused unless --resume or --overwrite.",
    )
    p.add_argument("--out", type=Path, default=Path("runs/shakespeare"), help="output directory (default runs/shakespeare)")
    p.add_argument("--preset", default="tiny", choices=sorted(GPT_PRESETS), help="model size (default tiny)")
    p.add_argument("--experts", dest="num_experts", type=int, default=None, help="override the preset's E")
    p.add_argument("--top-k", type=int, default=None, help="override the preset's K")
    p.add_argument("--capacity-factor", type=float, default=None, help="override cf (0 dropless, the preset default)")
    p.add_argument("--moe-every", type=int, default=None, help="MoE FFN on every n-th block (fairseq moe_freq)")
    p.add_argument("--load-balance-coef", type=float, default=None, help="override the router's balance-loss coefficient")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--tokenizer", default="byte", choices=["byte", "bpe"], help="bytes, or a BPE trained on the training works")
    p.add_argument("--bpe-vocab", type=int, default=1024)
    p.add_argument("--val-works", default=",".join(DEFAULT_VAL_WORKS), help="comma-separated works held out for validation")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", dest="warmup_steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"],
                   help="autocast; auto = bf16 on CUDA, fp32 on CPU (no native bf16 on most CPUs)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint up to --steps (if it is already "
                   "there: say so, touch nothing and exit 0; --steps below it is refused)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in --out, deleting the run there: its checkpoints, run.json, history.json, "
                   "training.png, tuned.json, train_config.json (no other file)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms: the run repeats bit for bit (same machine and ranks)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--nproc", type=int, default=None, help="expert parallelism: N local ranks through torchrun (gloo on CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default 2; 1 with --nproc)")
    p.add_argument("--parallel", default="expert", choices=["expert", "data", "auto"],
                   help="with --nproc: the MoE layers' parallel mode (auto: tuned at run time)")
    p.add_argument("--overlap-degree", type=lambda v: v if v == "auto" else int(v), default=1,
                   help="with --nproc: pipelining chunks of the exchange (an int, or auto)")
    p.add_argument("--tuned", type=Path, default=None,
                   help="with --parallel/--overlap-degree auto: lock the choices of an earlier run's tuned.json")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="with --nproc: split the embedding and tied output projection by vocabulary rows")
    p.add_argument("--rebalance-every", type=int, default=0,
                   help="with --nproc: move experts to a load-aware placement every N steps (0: never)")
    p.add_argument("--expert-slots", type=int, default=0,
                   help="with --rebalance-every: experts each rank may hold (default E/ranks; more allows replicas)")
    p.add_argument("--sample-tokens", type=int, default=300, help="tokens to sample from the final checkpoint (0: none)")
    p.add_argument("--prompt", default="ROMEO.\n")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    import torch

    from moeflow.checkpoint import CheckpointError
    from moeflow.parallel.launch import run_torchrun
    from moeflow.train import LMTrainConfig, train_lm
    from moeflow.train.data import CorpusError, load_corpus
    from moeflow.train.lm import check_world_settings
    from moeflow.train.lm_checkpoint import claim_run, inspect_run

    args.val_works = tuple(w.strip() for w in args.val_works.split(",") if w.strip())
    cfg = config_from_flags(LMTrainConfig, args, out_dir=args.out, prog="moeflow train")
    if cfg is None:
        return 2
    if args.nproc is not None and args.nproc < 1:
        print(f"moeflow train: error: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    world = args.nproc or 1
    if (cfg.vocab_parallel or cfg.rebalance_every) and world < 2:
        print("moeflow train: error: --vocab-parallel and --rebalance-every need --nproc >= 2", file=sys.stderr)
        return 2
    E = cfg.model_config(vocab_size=256).num_experts
    if cfg.expert_slots and not E // world <= cfg.expert_slots <= E:
        print(f"moeflow train: error: --expert-slots must lie in [E / nproc, E] = [{E // world}, {E}], "
              f"got {cfg.expert_slots}", file=sys.stderr)
        return 2
    if cfg.expert_slots and not cfg.rebalance_every:
        print("moeflow train: error: --expert-slots applies with --rebalance-every N", file=sys.stderr)
        return 2
    try:  # everything that can be refused is, before any rank starts
        check_world_settings(cfg, world)
        load_corpus(cfg.val_works)
        run = inspect_run(cfg)
    except (CorpusError, CheckpointError, ValueError) as err:
        print(f"moeflow train: error: {err}", file=sys.stderr)
        return 2
    if run.finished:
        print(f"moeflow train: the run in {cfg.out_dir} already finished step {run.start} of --steps {cfg.steps} "
              f"({run.checkpoint}); nothing to do (raise --steps to continue it)")
        return 0
    if run.start:
        print(f"resuming the run in {cfg.out_dir} at step {run.start} ({run.checkpoint}), up to step {cfg.steps}")
    elif run.remove:
        print(f"--overwrite: deleting the run files in {cfg.out_dir}: {', '.join(str(p.relative_to(cfg.out_dir)) for p in run.remove)}")
    try:
        if args.nproc:
            # the directory is claimed here, so the workers continue this run (resume=True): a
            # restarted worker then resumes from the latest checkpoint instead of starting over
            claim_run(cfg, run)
            path = cfg.out_dir / "train_config.json"
            path.write_text(json.dumps({**cfg.to_dict(), "resume": True, "overwrite": False}, indent=2))
            print(f"training on {args.nproc} expert-parallel ranks (torchrun, {args.threads or 1} thread(s) each)")
            run_torchrun("moeflow.train.worker", [str(path)], nproc=args.nproc, threads=args.threads or 1, stream=True)
            history = json.loads((cfg.out_dir / "history.json").read_text())
        else:
            torch.set_num_threads(args.threads or 2)
            history = train_lm(cfg)
    except (CorpusError, CheckpointError, ValueError) as err:
        print(f"moeflow train: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"moeflow train: error: {err}", file=sys.stderr)
        return 1
    (_, before), (s1, after) = history["val"][0], history["val"][-1]
    print(f"validation loss (held-out works) before training: {before:.4f} nats/token (perplexity {math.exp(before):.2f})")
    print(f"validation loss after {s1} steps:                  {after:.4f} nats/token (perplexity {math.exp(after):.2f})")
    print(f"throughput: {history['tokens_per_s']:,.0f} tokens/s on {history['world_size']} rank(s)")
    print(f"checkpoint: {history['checkpoint']}")
    if cfg.plot:
        print(f"plot: {cfg.out_dir / 'training.png'}")
    if args.sample_tokens > 0:
        print(f"\nsample ({args.sample_tokens} tokens, temperature 0.8, top-k 40):")
        print(sample(history["checkpoint"], args.prompt.replace("\\n", "\n"), args.sample_tokens, 0.8, 40, args.seed))
    return 0


def add_train_vision(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-vision", help="train the vision MoE on scikit-learn's digits and report test accuracy",
                       description="Train a ViT with MoE MLP blocks (V-MoE / SwinV2-MoE style) on the 1,797 8x8 "
                       "handwritten digits of scikit-learn, 25% held out for the test accuracy.")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--experts", dest="num_experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--router", default="linear", choices=["linear", "cosine"])
    p.add_argument("--drop-policy", default="position", choices=["position", "score", "bpr"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=_run_train_vision)


def _run_train_vision(args: argparse.Namespace) -> int:
    import torch

    from moeflow.train.vision import VisionTrainConfig, train_vision

    cfg = config_from_flags(VisionTrainConfig, args, prog="moeflow train-vision")
    if cfg is None:
        return 2
    torch.set_num_threads(args.threads)
    result = train_vision(cfg)
    print(f"test accuracy: {result['test_accuracy']:.4f} on {result['test_images']} held-out digits "
          f"(before training {result['test_accuracy_before']:.4f}; {result['seconds']:.1f} s)")
    return 0
