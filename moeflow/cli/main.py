"""``moeflow`` command line: ``moeflow bench|train|generate|infer|train-vision|a2a-model|convert ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from moeflow.cli.infer import add_infer

__all__ = ["main", "build_parser"]


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time the MoE layer beside the einsum/loop references and the expert-GEMM floor",
        description="Time moeflow, the GShard einsum reference, the per-expert loop reference and the "
        "floor (bare expert FFN on balanced input), forward and forward+backward, in one process.",
    )
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens per call (default 4096)")
    p.add_argument("--dim", type=int, default=512, help="D, model dim (default 512)")
    p.add_argument("--hidden", type=int, default=1024, help="H, expert hidden dim (default 1024)")
    p.add_argument("--experts", type=int, default=8, help="E, number of experts (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="K, experts per token (default 2)")
    p.add_argument(
        "--capacity-factor", type=float, default=1.0, help="cf: >0 fixed capacity, 0 dropless, <0 dropless capped (default 1.0)"
    )
    p.add_argument("--activation", default="swiglu", choices=["relu", "gelu", "silu", "swiglu", "geglu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default 2; 1 with --nproc)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per implementation (default 7)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up repeats (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--impls", default="moeflow,einsum,loop,floor", help="comma-separated subset of moeflow,einsum,loop,floor"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the (untimed) peak-memory pass")
    p.add_argument(
        "--nproc", type=int, default=None,
        help="expert parallelism: launch N local ranks with torchrun (T tokens and E/N experts each) "
        "and compare with one rank holding all experts",
    )
    p.add_argument("--node-size", type=int, default=None, help="with --nproc: ranks per node for the two-level exchange")
    p.add_argument("--hidden-shards", type=int, default=1,
                   help="with --nproc: split every expert's hidden units over this many ranks (allows E < nproc)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="with --nproc: force this share of tokens onto expert 0 and compare contiguous experts "
                        "with a load-aware placement")
    p.add_argument("--expert-slots", type=int, default=0,
                   help="with --skew: experts per rank for the placement (default E/nproc; more allows replicas)")
    p.add_argument("--sweep", action="store_true",
                   help="with --nproc: also time every parallel mode / overlap_degree and the auto-tuner's choice")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the full report as JSON")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        return _run_parallel_bench(args)
    if args.sweep or args.skew or args.expert_slots or args.hidden_shards != 1:
        print("moeflow bench: error: --sweep, --skew, --expert-slots and --hidden-shards need --nproc N", file=sys.stderr)
        return 2
    from moeflow.bench import BenchConfig, format_table, run_layer_bench

    if args.threads is None:
        args.threads = 2
    impls = tuple(s.strip() for s in args.impls.split(",") if s.strip())
    cfg = _config_from_flags(BenchConfig, args, impls=impls, memory=not args.no_memory)
    if cfg is None:
        return 2
    report = run_layer_bench(cfg, progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    return _show(format_table(report), report, args.json)


def _config_from_flags(config_cls, args: argparse.Namespace, prog: str = "moeflow bench", **overrides):  # type: ignore[no-untyped-def]
    """Build a config dataclass from the parsed flags of the same names; None (after printing
    the error) when it rejects a value."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    try:
        return config_cls(**{**flags, **overrides})
    except (ValueError, TypeError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return None


def _show(table: str, report: dict, json_path: Path | None) -> int:
    print(table)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {json_path}")
    return 0


def _run_parallel_bench(args: argparse.Namespace) -> int:
    from moeflow.bench.parallel import ParallelBenchConfig, format_parallel_table, run_parallel_bench

    if args.threads is None:
        args.threads = 1
    if args.device != "cpu" or args.impls != "moeflow,einsum,loop,floor":
        print("moeflow bench: error: --nproc runs the moeflow layer on this machine's devices; "
              "--device/--impls do not apply", file=sys.stderr)
        return 2
    cfg = _config_from_flags(ParallelBenchConfig, args)
    if cfg is None:
        return 2
    report = run_parallel_bench(cfg)
    return _show(format_parallel_table(report), report, args.json)


def _add_a2a_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "a2a-model",
        help="predicted flat vs two-level all-to-all times for 16..2048 ranks, and the crossover",
        description="Latency + bytes/bandwidth model of the flat and two-level all-to-all "
        "(moeflow.parallel.costmodel). Defaults: 8-GPU NVLink nodes on 400 Gb/s InfiniBand.",
    )
    p.add_argument("--bytes-per-rank", type=float, default=2 * 4096 * 4096 * 2.0,
                   help="bytes each rank exchanges (default: T=4096, K=2, D=4096, bf16 = 64 MiB)")
    p.add_argument("--node-size", type=int, default=8)
    p.add_argument("--calibrate", action="store_true",
                   help="also measure gloo all-to-all between 2 local ranks and print the model with those parameters")
    p.set_defaults(func=_run_a2a_model)


def _model_table(bytes_per_rank: float, links, title: str) -> str:  # type: ignore[no-untyped-def]
    from moeflow.parallel.costmodel import crossover, flat_time, two_level_time

    worlds = [w for w in (16, 32, 64, 128, 256, 512, 1024, 2048) if w % links.node_size == 0]
    lines = [title, f"{'ranks':>7}{'flat ms':>12}{'2-level ms':>13}{'2-level/flat':>14}"]
    for w in worlds:
        f, t = flat_time(w, bytes_per_rank, links), two_level_time(w, bytes_per_rank, links)
        lines.append(f"{w:>7}{f * 1e3:>12.3f}{t * 1e3:>13.3f}{t / f:>14.2f}")
    cross = crossover(bytes_per_rank, links, worlds)
    lines.append(f"crossover: two-level is faster from {cross} ranks on" if cross else "crossover: none in 16..2048")
    return "\n".join(lines)


def _copy_bandwidth() -> float:
    import statistics
    import time

    import torch

    src = torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[1:])  # read + write


def _run_a2a_model(args: argparse.Namespace) -> int:
    import tempfile

    from moeflow.parallel.costmodel import LinkModel
    from moeflow.parallel.launch import run_torchrun

    try:
        links = LinkModel(node_size=args.node_size)
    except ValueError as err:
        print(f"moeflow a2a-model: error: {err}", file=sys.stderr)
        return 2
    mib = args.bytes_per_rank / 2**20
    print(_model_table(args.bytes_per_rank, links,
                       f"NVLink nodes of {links.node_size} on 400 Gb/s InfiniBand, {mib:.0f} MiB per rank:"))
    if not args.calibrate:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cal.json"
        try:
            run_torchrun("moeflow.parallel.calibrate", [str(out)], nproc=2, threads=1)
        except RuntimeError as err:
            print(f"moeflow a2a-model: error: {err}", file=sys.stderr)
            return 1
        cal = json.loads(out.read_text())
    a, b = cal["latency_s"], cal["bandwidth_Bps"]
    print(f"\ncalibration ({cal['backend']}, {cal['world']} local ranks, all_to_all_single, median of 15):")
    for sent, sec in cal["points"]:
        print(f"  {sent / 2**10:>9.0f} KiB sent per rank: {sec * 1e3:8.3f} ms  (fit {(a + sent / b) * 1e3:8.3f} ms)")
    print(f"  fit: latency {a * 1e6:.1f} us per exchange, bandwidth {b / 1e9:.2f} GB/s per rank")
    copy_bw = _copy_bandwidth()
    print(f"  host memory copy: {copy_bw / 1e9:.1f} GB/s (64 MiB tensor copy, median of 5), used for the reorders")
    gloo = LinkModel(node_size=args.node_size, intra_latency=a, intra_bandwidth=b, inter_latency=a,
                     inter_bandwidth=b, memory_bandwidth=copy_bw)
    print()
    print(_model_table(args.bytes_per_rank, gloo,
                       f"gloo-calibrated links (intra = inter = this machine's loopback), {mib:.0f} MiB per rank:"))
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="inspect or reshard a checkpoint; import/export Mixtral weights from/to Hugging Face",
        description="Inspect (--info) or reshard a moeflow checkpoint. Checkpoints store every expert under "
        "its global index, so any world size can load any checkpoint; resharding only regroups the files "
        "(e.g. --world-size 1 gathers everything into one file). --from-hf HF_DIR DST writes a moeflow "
        "checkpoint of a Mixtral model directory; SRC --to-hf HF_DIR writes a moeflow MoE GPT checkpoint "
        "as a Mixtral directory (both exact).",
    )
    p.add_argument("paths", type=Path, nargs="*", metavar="PATH",
                   help="SRC [DST]: a checkpoint directory (or a root: its latest complete checkpoint) and the "
                   "destination root; with --from-hf only DST")
    p.add_argument("--world-size", type=int, default=None, help="number of rank files to write")
    p.add_argument("--info", action="store_true", help="print layers, experts, shapes and files, then exit")
    p.add_argument("--from-hf", type=Path, default=None, metavar="HF_DIR", help="import a Mixtral model directory")
    p.add_argument("--to-hf", type=Path, default=None, metavar="HF_DIR", help="export to a Mixtral model directory")
    p.set_defaults(func=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from moeflow.checkpoint import CheckpointError, describe_checkpoint, latest_checkpoint, reshard_checkpoint

    def fail(msg: str) -> int:
        print(f"moeflow convert: error: {msg}", file=sys.stderr)
        return 2

    paths = list(args.paths)
    try:
        if args.from_hf is not None:
            if len(paths) != 1 or args.to_hf is not None:
                return fail("usage: moeflow convert --from-hf HF_DIR DST")
            return _convert_from_hf(args.from_hf, paths[0])
        if not paths:
            return fail("give SRC (and DST --world-size N, --info or --to-hf HF_DIR)")
        src = paths[0]
        if not (src / "index.json").exists():
            src = latest_checkpoint(src) or latest_checkpoint(src / "checkpoints") or src
        if args.to_hf is not None:
            from moeflow.models.hf import gpt_to_hf
            from moeflow.train import build_from_checkpoint

            model, _, _ = build_from_checkpoint(src)
            print(f"wrote {gpt_to_hf(model, args.to_hf)} (Mixtral, {model.config.n_layers} layers, "
                  f"{model.config.num_experts} experts)")
            return 0
        if args.info:
            print(describe_checkpoint(src))
            return 0
        if len(paths) != 2 or args.world_size is None:
            return fail("give DST and --world-size (or --info, --to-hf)")
        out = reshard_checkpoint(src, paths[1], args.world_size)
    except (CheckpointError, ValueError, TypeError) as err:
        return fail(str(err))
    print(f"wrote {out} for {args.world_size} rank(s)")
    return 0


def _convert_from_hf(hf_dir: Path, dst: Path) -> int:
    from moeflow.checkpoint import save_checkpoint
    from moeflow.models.hf import gpt_from_hf
    from moeflow.train.lm import MODEL_FAMILY

    model = gpt_from_hf(hf_dir)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    extra = {"family": MODEL_FAMILY, "model": model.config.to_dict(), "dtype": dtype, "tokenizer": None,
             "source": str(hf_dir)}
    out = save_checkpoint(dst, 0, model, extra=extra)
    print(f"wrote {out} (MoE GPT from Mixtral: {model.config.n_layers} layers, {model.config.num_experts} experts)")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from moeflow.models import GPT_PRESETS
    from moeflow.train.data import DEFAULT_VAL_WORKS

    p = sub.add_parser(
        "train",
        help="train the MoE GPT on the Shakespeare corpus (one process or N expert-parallel ranks)",
        description="Train moeflow's MoE GPT language model on the 42 works of the `shakespeare` package, "
        "holding out whole works for validation. Prints the validation loss before and after, writes "
        "checkpoints, history.json and training.png (loss curves + per-layer expert load) under --out, "
        "and prints a sample from the final checkpoint.",
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
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
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
    from moeflow.train.data import CorpusError, corpus_dir

    args.val_works = tuple(w.strip() for w in args.val_works.split(",") if w.strip())
    cfg = _config_from_flags(LMTrainConfig, args, out_dir=args.out, prog="moeflow train")
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
    try:
        corpus_dir()
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        if args.nproc:
            path = cfg.out_dir / "train_config.json"
            path.write_text(json.dumps(cfg.to_dict(), indent=2))
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
    (s0, before), (s1, after) = history["val"][0], history["val"][-1]
    print(f"validation loss (held-out works) before training: {before:.4f} nats/token (perplexity {math.exp(before):.2f})")
    print(f"validation loss after {s1} steps:                  {after:.4f} nats/token (perplexity {math.exp(after):.2f})")
    print(f"throughput: {history['tokens_per_s']:,.0f} tokens/s on {history['world_size']} rank(s)")
    print(f"checkpoint: {history['checkpoint']}")
    if cfg.plot:
        print(f"plot: {cfg.out_dir / 'training.png'}")
    if args.sample_tokens > 0:
        print(f"\nsample ({args.sample_tokens} tokens, temperature 0.8, top-k 40):")
        print(_sample(history["checkpoint"], args.prompt.replace("\\n", "\n"), args.sample_tokens, 0.8, 40, args.seed))
    return 0


def _sample(checkpoint: str, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
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


def _add_generate(sub: argparse._SubParsersAction) -> None:
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
        print(_sample(str(args.checkpoint), args.prompt.replace("\\n", "\n"), args.tokens, args.temperature,
                      args.top_k or None, args.seed))
    except (CheckpointError, ValueError, TypeError) as err:
        print(f"moeflow generate: error: {err}", file=sys.stderr)
        return 2
    return 0


def _add_train_vision(sub: argparse._SubParsersAction) -> None:
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

    cfg = _config_from_flags(VisionTrainConfig, args, prog="moeflow train-vision")
    if cfg is None:
        return 2
    torch.set_num_threads(args.threads)
    result = train_vision(cfg)
    print(f"test accuracy: {result['test_accuracy']:.4f} on {result['test_images']} held-out digits "
          f"(before training {result['test_accuracy_before']:.4f}; {result['seconds']:.1f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeflow", description="Mixture-of-Experts layers for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_bench(sub)
    _add_a2a_model(sub)
    _add_convert(sub)
    _add_train(sub)
    _add_generate(sub)
    add_infer(sub)
    _add_train_vision(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
