"""How a ``moeflow train`` run starts its ranks and reports (``moeflow.cli.train`` parses and
checks the flags): ``--nproc N`` starts a torchrun job on this machine (``start_ranks``); each
rank of a torchrun job trains with the others (``train_rank``); rank 0 (or the one process)
says what the run does in ``--out`` (``announce``, which also writes ``config.toml``) and sums
it up at the end (``summarize``). Errors are one line naming the flags (``error``)."""

from __future__ import annotations

import argparse
import math
import sys

from moeflow.cli.errors import error_line
from moeflow.cli.flags import config_toml, env_threads, name_flags
from moeflow.cli.generate import sample

__all__ = ["NOT_IN_CONFIG", "announce", "error", "start_ranks", "summarize", "train_rank"]

# run-directory actions and the file itself: not settings of the run, so not in config.toml
NOT_IN_CONFIG = ("config", "resume", "overwrite")


def error(args: argparse.Namespace, message: object) -> None:
    """One line on stderr, naming the flags (``--out``) where the library named fields (``out_dir``)."""
    print(error_line("moeflow train", name_flags(str(message), getattr(args, "flag_names", {}))), file=sys.stderr)


def start_ranks(args: argparse.Namespace) -> int:
    """``--nproc N``: ``torchrun --nproc-per-node N -m moeflow train`` with the other flags. The
    job goes with this process, even one killed with SIGKILL: its agent and ranks arm their
    death with their parent (``run_torchrun``, ``moeflow.parallel.launch.torchrun.die_with_parent``)."""
    from moeflow.parallel.launch.torchrun import run_torchrun

    launcher = argparse.ArgumentParser(add_help=False)  # the flags of this process, not of the ranks
    launcher.add_argument("--nproc")
    launcher.add_argument("--max-restarts")
    _, flags = launcher.parse_known_args(args.argv[1:])
    threads, restarts = args.threads or env_threads() or 1, args.max_restarts or 0
    print(f"training on {args.nproc} expert-parallel ranks (torchrun, {threads} thread(s) each"
          + (f", up to {restarts} restart(s)" if restarts else "") + ")", flush=True)
    try:
        run_torchrun("moeflow", ["train", *flags], nproc=args.nproc, threads=threads, stream=True,
                     max_restarts=restarts)
    except RuntimeError as err:
        error(args, err)
        return 1
    return 0


def train_rank(args: argparse.Namespace, cfg, job) -> int:  # type: ignore[no-untyped-def]
    """This process is one rank of a torchrun job: train with the others (``moeflow.train.worker``)."""
    import dataclasses

    import torch

    from moeflow.checkpoint import CheckpointError
    from moeflow.train.data import CorpusError
    from moeflow.train.nonfinite import NonFiniteLossError
    from moeflow.train.worker import run_rank

    lead = job.rank == 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if not lead:  # one progress bar, one plot
        cfg = dataclasses.replace(cfg, progress=False, plot=False)
    try:
        on_run = (lambda run, continuing: announce(cfg, run, continuing, args)) if lead else None
        history = run_rank(cfg, job, on_run=on_run)
    except (CorpusError, CheckpointError, ValueError) as err:
        if lead:  # every rank raised it (rank 0's verdict is shared); rank 0 reports it
            error(args, err)
        return 2
    except NonFiniteLossError as err:
        if lead:  # every rank stopped at the same step (the loss and gradient norm are reduced)
            error(args, err)
        return 1
    except RuntimeError as err:
        print(f"moeflow train: error on rank {job.rank}: {err}", file=sys.stderr)
        return 1
    if lead and history is not None:
        summarize(history, cfg, args)
    return 0


def announce(cfg, run, continuing: bool = False,  # type: ignore[no-untyped-def]
             args: argparse.Namespace | None = None) -> None:
    """What the run in ``out_dir`` does (``run``: ``inspect_run``'s verdict); a run that
    trains records its effective flags in ``out_dir/config.toml`` (``--config`` reads it back)."""
    if args is not None and not run.finished:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        (cfg.out_dir / "config.toml").write_text(
            "# the effective flags of this run (moeflow train --config reads it; flags override it)\n"
            + config_toml(args, args.parser, skip=NOT_IN_CONFIG))
    if continuing:
        at = f"step {run.start} ({run.checkpoint})" if run.start else "step 0 (no checkpoint yet)"
        print(f"torchrun restarted the ranks: continuing the run in {cfg.out_dir} from {at}", flush=True)
    if run.finished:
        print(f"moeflow train: the run in {cfg.out_dir} already finished step {run.start} of --steps {cfg.steps} "
              f"({run.checkpoint}); nothing to do (raise --steps to continue it)")
    elif run.start and not continuing:
        print(f"resuming the run in {cfg.out_dir} at step {run.start} ({run.checkpoint}), up to step {cfg.steps}")
    elif run.remove:
        print(f"--overwrite: deleting the run files in {cfg.out_dir}: "
              f"{', '.join(str(p.relative_to(cfg.out_dir)) for p in run.remove)}")


def summarize(history: dict, cfg, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    (_, before), (s1, after) = history["val"][0], history["val"][-1]
    held = "held-out data" if cfg.data else "held-out works"
    print(f"validation loss ({held}) before training: {before:.4f} nats/token (perplexity {math.exp(before):.2f})")
    print(f"validation loss after {s1} steps:{' ' * (len(held) + 20 - len(str(s1)) - 13)}{after:.4f} nats/token "
          f"(perplexity {math.exp(after):.2f})")
    if "data_share" in history:  # how long the steps waited for their batch (read one ahead; not in older runs)
        print(f"data: the steps waited {history['data_wait_s']:.3f} s for their batches "
              f"({100 * history['data_share']:.2f}% of the training time)")
    ranks = history["world_size"]
    how = f" ({history['exchange']} exchange)" if history.get("exchange") else ""
    print(f"throughput: {history['tokens_per_s']:,.0f} tokens/s on {ranks} rank(s){how}")
    print(f"checkpoint: {history['checkpoint']}")
    if cfg.plot:
        print(f"plot: {cfg.out_dir / 'training.png'}")
    if args.sample_tokens > 0:
        print(f"\nsample ({args.sample_tokens} tokens, temperature 0.8, top-k 40):")
        print(sample(history["checkpoint"], args.prompt.replace("\\n", "\n"), args.sample_tokens, 0.8, 40, args.seed,
                     device=cfg.device))  # on the run's device (its GPU under CUDA)
