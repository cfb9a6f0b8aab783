"""``moeflow train``: the MoE GPT on Shakespeare: one process, or one rank of a torchrun job, or
``--nproc N``, which starts such a job on this machine (``moeflow train-vision``:
``moeflow.cli.train_vision``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

from moeflow.cli.errors import UsageError
from moeflow.cli.flags import (
    DEVICE_HELP,
    DeviceChoice,
    apply_config_file,
    check_output_dir,
    choose_device,
    config_from_flags,
    env_threads,
    int_at_least,
    threads_help,
)
from moeflow.cli.train_run import (
    NOT_IN_CONFIG,
    announce,
    error,
    start_ranks,
    summarize,
    train_rank,
)

__all__ = ["add_train"]

DEFAULT_WARMUP = 30  # steps; cut to a tenth of --steps in a shorter run (``_resolve_warmup``)


def add_train(sub: argparse._SubParsersAction) -> None:
    from moeflow.models import GPT_PRESETS
    from moeflow.train.data import DEFAULT_VAL_WORKS
    from moeflow.train.prepare import DEFAULT_VAL_FRACTION

    p = sub.add_parser(
        "train",
        help="train the MoE GPT on the Shakespeare corpus (one process, or expert-parallel ranks under torchrun)",
        description="Train moeflow's MoE GPT language model on the 42 works of the `shakespeare` package, "
        "holding out whole works for validation. Prints the validation loss before and after, writes "
        "checkpoints, history.json and training.png (loss curves + per-layer expert load) under --out, "
        "and prints a sample from the final checkpoint. --out holds one run: a new run into a directory "
        "that holds another is refused unless --resume or --overwrite. Under torchrun "
        "(`torchrun [--nnodes ...] --nproc-per-node P -m moeflow train ...`) every rank runs this command "
        "and the experts spread over all ranks of all nodes; --nproc N starts that on this machine.",
        epilog="max_load (progress lines, metrics.jsonl): the busiest expert's share of its layer's token-to-expert "
        "assignments over the even share 1/E, averaged over the MoE layers: 1.00x is perfectly balanced, 2.00x means "
        "the busiest expert got twice its share (with --capacity-factor c > 0, tokens past c x the even share are "
        "dropped). Logged every --log-every steps, over the steps since the previous log.",
    )
    p.add_argument("--out", type=Path, default=Path("runs/shakespeare"), help="output directory (default runs/shakespeare)")
    p.add_argument("--preset", default="tiny", choices=sorted(GPT_PRESETS), help="model size (default tiny)")
    p.add_argument("--experts", dest="num_experts", type=int, default=None,
                   help="override the preset's E, experts per MoE layer (default: the preset's)")
    p.add_argument("--top-k", type=int, default=None,
                   help="override the preset's K: the router's k, experts per token (not generate's "
                   "--sample-top-k; default: the preset's)")
    p.add_argument("--capacity-factor", type=float, default=None, help="override cf (0 dropless, the preset default)")
    p.add_argument("--moe-every", type=int, default=None,
                   help="MoE FFN on every n-th block (fairseq moe_freq; default: the preset's)")
    p.add_argument("--load-balance-coef", type=float, default=None,
                   help="override the router's balance-loss coefficient (default: the preset's)")
    p.add_argument("--layers", dest="n_layers", type=int, default=None,
                   help="override the preset's number of blocks (default: the preset's)")
    p.add_argument("--dim", type=int, default=None, help="override the preset's model width (default: the preset's)")
    p.add_argument("--heads", dest="n_heads", type=int, default=None,
                   help="override the preset's attention heads; must divide --dim (default: the preset's)")
    p.add_argument("--experts-hidden", dest="expert_hidden", type=int, default=None,
                   help="override the preset's expert FFN width (default: the preset's)")
    p.add_argument("--expert-recompute", dest="expert_recompute", action="store_true",
                   help="experts keep only their input rows and recompute the hidden activation in backward: "
                   "the same gradients with less activation memory, at more time")
    p.add_argument("--init-from", dest="init_from", type=Path, default=None, metavar="CKPT|HF_DIR",
                   help="start from the weights of this checkpoint (or run directory: one `moeflow convert "
                   "--from-hf` wrote, or an earlier run's) or Hugging Face model directory (config.json, safetensors, "
                   "tokenizer.json; converted in memory, every rank reading it); the model and tokenizer are its own "
                   "(the model flags above are refused, --preset and --tokenizer unused), the optimizer and step "
                   "start fresh in a new --out, whose checkpoints keep its special tokens and Hugging Face files "
                   "for generate and convert --to-hf (default: random initial weights)")
    p.add_argument("--seq-len", type=int, default=128,
                   help="model context: tokens per training sequence, and the longest prompt + output the model "
                   "takes (infer's --seq-len is a prompt length)")
    p.add_argument("--data", action="append", default=None, metavar="SOURCE[@WEIGHT]",
                   help="train on your own data instead of Shakespeare: a text file or a folder of them, .jsonl / .json "
                   "(the text in --text-field), .parquet, a datasets directory (save_to_disk), hf:NAME from the "
                   "local datasets cache, or a folder `moeflow prepare-data` wrote; repeat to mix several, "
                   "@WEIGHT drawing from each in that proportion (raw sources are tokenized once into --out/data; default: "
                   "the Shakespeare corpus)")
    p.add_argument("--val-data", action="append", default=None, metavar="SOURCE",
                   help="with --data: validation sources (default: --val-fraction of each raw --data source, or a "
                   "prepared one's own validation split)")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help="with --data and no --val-data: the share of each raw source held out for validation, whole "
                   "documents chosen by a hash of their index, or the last tokens (at least one window of --seq-len) "
                   "when there are too few documents; 0 holds out none, which needs --val-data (as `moeflow "
                   "prepare-data`'s --val-fraction, with the same default)")
    p.add_argument("--text-field", default="text", help="with --data: the JSON key or column holding the text")
    p.add_argument("--skip-empty", action="store_true",
                   help="with --data: skip empty documents (counted in the log) instead of refusing them")
    p.add_argument("--mmap-window", type=int, default=256 << 20, metavar="BYTES",
                   help="with --data: the bytes of each token file memory-mapped at a time (resident memory stays "
                   "within it however large the corpus)")
    p.add_argument("--tokenizer", default="byte", metavar="byte|bpe|PATH",
                   help="bytes, a BPE trained on the training text, or (with --data) a Hugging Face tokenizer.json or "
                   "a model directory holding one")
    p.add_argument("--bpe-vocab", type=int, default=1024, help="with --tokenizer bpe: the vocabulary size")
    p.add_argument("--val-works", default=",".join(DEFAULT_VAL_WORKS), help="comma-separated works held out for validation")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (the total, also with --resume)")
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW), reached after --warmup")
    p.add_argument("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine decay")
    p.add_argument("--warmup", dest="warmup_steps", type=int, default=None, metavar="N",
                   help=f"linear warm-up steps to the peak --lr (default {DEFAULT_WARMUP}; when --steps is not above "
                   "that, a tenth of --steps, with a note saying so; an explicit --warmup above --steps is refused): "
                   "a run that never reaches its --lr is almost never meant, and a short trial run should not need "
                   "--warmup spelled out to be right")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay (matrices and experts; none on norms and biases)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this")
    p.add_argument("--eval-every", type=int, default=100,
                   help="validation loss every N steps (0: before and after only)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="batches of --batch-size held-out sequences per validation")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--skip-nonfinite", type=int, default=0, metavar="N",
                   help="a step whose loss or gradient is nan/inf stops the run (exit 1; the latest checkpoint is "
                   "the last good one, none is written after); with N > 0, up to N such steps are skipped instead "
                   "(no update; listed in history.json) and the next one stops the run")
    p.add_argument("--sync-checkpoints", dest="async_checkpoints", action="store_false",
                   help="write the --checkpoint-every saves before the next step (default: in the background, "
                   "the training waits only until the state is in host memory)")
    p.add_argument("--seed", type=int, default=0, help="initial weights, batch order, router noise")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"],
                   help="autocast; auto = bf16 on CUDA, fp32 on CPU (no native bf16 on most CPUs)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                   help="parameter dtype (float64: exact comparisons, e.g. ranks against one process)")
    p.add_argument("--device", default=None,
                   help=f"{DEVICE_HELP}; under torchrun (or --nproc) rank r of a machine runs on cuda:r (give cuda, "
                   "not cuda:N), and more ranks on a machine than it has GPUs are refused")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint up to --steps (if it is already "
                   "there: say so, touch nothing and exit 0; --steps below it is refused)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in --out, deleting the run there: its checkpoints, run.json, history.json, "
                   "training.png, tuned.json (no other file)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms: the run repeats bit for bit (same machine and ranks)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="plain progress lines (step, loss, lr, tokens/s, max_load) every --log-every steps instead "
                   "of a bar (the default when stderr is not a terminal: a log file, a pipe)")
    p.add_argument("--log-every", type=int_at_least(0), default=0, metavar="N",
                   help="gather the expert load and print a progress line every N steps (0: about 50 per run, "
                   "at least every 10 steps)")
    p.add_argument("--tensorboard", action="store_true",
                   help="also log every step's metrics (as in metrics.jsonl) to --out/tensorboard; needs the "
                   "tensorboard package: pip install 'moeflow[tensorboard]'")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw training.png")
    p.add_argument("--nproc", type=int_at_least(1), default=None,
                   help="expert parallelism on this machine: runs `torchrun --nproc-per-node N -m moeflow train` "
                   "with the other flags (gloo on CPU); for several machines start torchrun on each yourself (default: "
                   "one process, no torchrun)")
    p.add_argument("--max-restarts", type=int_at_least(0), default=None,
                   help="with --nproc: torchrun restarts the ranks up to N times after a failure, each time "
                   "continuing from the latest complete checkpoint (default 0)")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help=threads_help(2, "torch threads per process (with --nproc: per rank, where the fallback is 1)"))
    p.add_argument("--parallel", default="expert", choices=["expert", "data", "auto"],
                   help="with several ranks: the MoE layers' parallel mode (auto: tuned at run time)")
    p.add_argument("--overlap-degree", type=_overlap_degree, default=1,
                   help="with several ranks: pipelining chunks of the exchange (an int, or auto)")
    p.add_argument("--exchange", default="auto", choices=["auto", "flat", "two-level"],
                   help="with several ranks: the all-to-all, flat or two-level (inside each node, then across "
                   "nodes); auto (default): two-level when the ranks span more than one node")
    p.add_argument("--tuned", type=Path, default=None,
                   help="with --parallel/--overlap-degree auto: lock the choices of an earlier run's tuned.json "
                   "(default: none, tune at run time)")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="with several ranks: split the embedding and tied output projection by vocabulary rows")
    p.add_argument("--rebalance-every", type=int, default=0,
                   help="with several ranks: move experts to a load-aware placement every N steps (0: never)")
    p.add_argument("--expert-slots", type=int, default=0,
                   help="with --rebalance-every: experts each rank may hold (default E/ranks; more allows replicas)")
    p.add_argument("--stall-timeout", dest="stall_timeout_s", type=float, default=30.0,
                   help="with several ranks: a rank whose heartbeat stops this many seconds is named and the job "
                   "stopped (default 30)")
    p.add_argument("--collective-timeout", dest="collective_timeout_s", type=float, default=300.0,
                   help="with several ranks: the longest one collective may wait, in seconds (default 300)")
    p.add_argument("--sample-tokens", type=int_at_least(0), default=300, help="tokens to sample from the final checkpoint (0: none)")
    p.add_argument("--config", type=Path, default=None, metavar="TOML",
                   help="read flags from this TOML file: keys are the flags' destinations as in the config.toml a "
                   "run writes (steps = 300, num_experts = 8, warmup_steps = 30, progress = false); flags on the "
                   "command line override it; an unknown key is refused (default: none)")
    p.add_argument("--prompt", default="ROMEO.\n", help="prompt of the final sample (\\n: a new line)")
    p.set_defaults(func=_run_train, parser=p)


def _overlap_degree(text: str) -> int | str:
    """``--overlap-degree``: ``auto`` or an integer (its range is ``ParallelConfig``'s)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def _resolve_warmup(args: argparse.Namespace) -> str | None:
    """Set ``args.warmup_steps`` when it was not given (``DEFAULT_WARMUP``, or a tenth of
    ``--steps`` when that is not above it, so that the peak --lr is reached); returns the note
    to print then (None: nothing to say). An explicit ``--warmup`` above ``--steps`` is refused
    (``UsageError``): the user asked for a schedule the run cannot finish."""
    steps, warmup = args.steps, args.warmup_steps
    if not isinstance(steps, int) or steps < 1:
        args.warmup_steps = DEFAULT_WARMUP if warmup is None else warmup  # --steps itself is refused later
        return None
    if warmup is None:
        if steps > DEFAULT_WARMUP:
            args.warmup_steps = DEFAULT_WARMUP
            return None
        args.warmup_steps = steps // 10
        return (f"note: --steps {steps} is not above the default --warmup {DEFAULT_WARMUP}: warming up over "
                f"{args.warmup_steps} step(s) instead (a tenth of the run), so the peak --lr {args.lr:g} is "
                "reached; give --warmup to choose")
    if warmup > steps:
        raise UsageError(f"--warmup {warmup} is above --steps {steps}: the learning rate would never reach "
                         f"--lr {args.lr:g}; lower --warmup (at most {steps}) or raise --steps")
    return None


def _device(args: argparse.Namespace, job) -> DeviceChoice:  # type: ignore[no-untyped-def]
    """``--device`` (or its default, CUDA where available) of this process: one process, or one
    GPU per rank of a torchrun job (this rank's ``cuda:LOCAL_RANK``), or with ``--nproc N`` the
    plan for the N ranks, checked here before any rank starts (``UsageError`` for a device this
    machine lacks, an index under torchrun, more ranks than GPUs). Every rank decides alike."""
    if job is not None:
        return choose_device("--device", args.device, ranks=job.local_world, local_rank=job.local_rank,
                             ranks_from=f"torchrun --nproc-per-node {job.local_world} (LOCAL_WORLD_SIZE)")
    if args.nproc is not None:
        return choose_device("--device", args.device, ranks=args.nproc, ranks_from=f"--nproc {args.nproc}")
    return choose_device("--device", args.device)


def _refusal(args: argparse.Namespace, cfg, job) -> str | None:  # type: ignore[no-untyped-def]
    """Why these flags cannot run (None: they can): the checks every rank makes alike, before
    any work (the run directory's contents are checked after these, by rank 0 under torchrun;
    the device before these, by ``_device``): ``--out`` can be written, the corpus and
    ``--tuned`` can be read, and the numbers suit the ranks (``--nproc N`` checks them here,
    before any rank starts)."""
    from moeflow.train.data import CorpusError, load_corpus
    from moeflow.train.lm import check_world_settings

    if job is not None and (args.nproc is not None or args.max_restarts is not None):
        return (f"--nproc and --max-restarts start torchrun, but this process already is rank {job.rank} of a "
                f"torchrun job of {job.world} ranks (give torchrun its own --max-restarts)")
    if cfg.tensorboard:
        from moeflow.train.metrics import tensorboard_missing

        if tensorboard_missing() is not None:
            return f"--tensorboard: {tensorboard_missing()}"
    if args.max_restarts is not None and args.nproc is None:
        return f"--max-restarts applies with --nproc and must be >= 0, got {args.max_restarts}"
    try:
        check_output_dir("--out", cfg.out_dir)
    except UsageError as err:
        return str(err)
    world = job.world if job is not None else args.nproc or 1
    if (cfg.vocab_parallel or cfg.rebalance_every) and world < 2:
        return "--vocab-parallel and --rebalance-every need --nproc >= 2 (or torchrun with more than one rank)"
    E = cfg.model_config(vocab_size=256).num_experts
    if cfg.expert_slots and not E // world <= cfg.expert_slots <= E:
        return f"--expert-slots must lie in [E / ranks, E] = [{E // world}, {E}], got {cfg.expert_slots}"
    if cfg.expert_slots and not cfg.rebalance_every:
        return "--expert-slots applies with --rebalance-every N"
    try:  # torchrun's LOCAL_WORLD_SIZE may differ between nodes: the ranks compare it once they are connected
        check_world_settings(cfg, world, args.nproc if job is None else None)
        if cfg.init_from is not None and not cfg.resume:  # a new run reads them (a resumed one continues its own)
            from moeflow.train.init_from import check_init_weights

            check_init_weights(cfg.init_from)
        if cfg.data:  # one's own sources: they exist (their contents are read, and checked, by the run)
            from moeflow.train.lm_config import source_weight

            for flag, sources in (("--data", [source_weight(s)[0] for s in cfg.data]), ("--val-data", cfg.val_data)):
                for source in sources:
                    if not source.startswith("hf:") and not Path(source).exists():
                        return f"{flag} {source}: no such file or folder"
            from moeflow.train.lm_data import validation_problem

            return validation_problem(cfg)  # before --out is claimed: a refused run leaves no run behind
        corpus = load_corpus(cfg.val_works)
    except (CorpusError, ValueError) as err:
        return str(err)
    shortest = min(len(corpus.train_text), len(corpus.val_text))  # characters: at least as many as tokens
    if cfg.seq_len + 1 >= shortest:
        return (f"--seq-len {cfg.seq_len} is longer than the held-out text ({len(corpus.val_text):,} characters) or "
                f"the training text ({len(corpus.train_text):,}): lower it, or hold out more --val-works")
    return None


def _run_train(args: argparse.Namespace) -> int:
    import torch

    from moeflow.checkpoint import CheckpointError
    from moeflow.parallel.launch.torchrun import torchrun_job
    from moeflow.train import LMTrainConfig, train_lm
    from moeflow.train.data import CorpusError
    from moeflow.train.lm_checkpoint import inspect_run
    from moeflow.train.nonfinite import NonFiniteLossError

    try:
        job = torchrun_job()
    except ValueError as err:
        error(args, err)
        return 2
    lead = job is None or job.rank == 0  # under torchrun every rank checks alike; rank 0 says why
    if args.config is not None:
        try:
            apply_config_file(args.parser, args, args.config, args.argv[1:], skip=NOT_IN_CONFIG)
        except UsageError as err:
            if lead:
                error(args, err)
            return 2
    # the config calls --out out_dir (and "out" is too common a word to stand for it)
    args.flag_names = {**{k: v for k, v in getattr(args, "flag_names", {}).items() if k != "out"}, "out_dir": "--out"}
    args.val_works = tuple(w.strip() for w in args.val_works.split(",") if w.strip())
    args.data, args.val_data = tuple(args.data or ()), tuple(args.val_data or ())
    try:
        warmup_note = _resolve_warmup(args)
    except UsageError as err:
        if lead:
            error(args, err)
        return 2
    try:
        device = _device(args, job)
    except UsageError as err:
        if lead:
            error(args, err)
        return 2
    with contextlib.redirect_stderr(sys.stderr if lead else io.StringIO()):
        cfg = config_from_flags(LMTrainConfig, args, out_dir=args.out, device=device.device, prog="moeflow train")
    problem = None if cfg is None else _refusal(args, cfg, job)
    if problem is not None and lead:
        error(args, problem)
    if cfg is None or problem is not None:
        return 2
    if job is not None:
        if lead:
            print(device.line, flush=True)
        if warmup_note and lead:
            print(warmup_note, flush=True)
        return train_rank(args, cfg, job)
    try:  # everything that can be refused is, before any rank starts
        run = inspect_run(cfg)
    except (CheckpointError, ValueError) as err:
        error(args, err)
        return 2
    if args.nproc and not run.finished:
        return start_ranks(args)  # rank 0 prints its device line
    if not run.finished:
        print(device.line, flush=True)
    if warmup_note and not run.finished:
        print(warmup_note, flush=True)
    announce(cfg, run, args=args)
    if run.finished:
        return 0
    try:
        torch.set_num_threads(args.threads or env_threads() or 2)
        history = train_lm(cfg)
    except (CorpusError, CheckpointError, ValueError) as err:
        error(args, err)
        return 2
    except NonFiniteLossError as err:
        error(args, err)
        return 1
    except RuntimeError as err:
        error(args, err)
        return 1
    summarize(history, cfg, args)
    return 0
