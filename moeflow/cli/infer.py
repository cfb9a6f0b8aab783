"""``moeflow infer``: run an MoE GPT with its experts offloaded to host memory or disk.

    moeflow infer --offload disk --fast-memory 512MB --preset small --new-tokens 16
    moeflow infer runs/shakespeare --offload disk --fast-memory 8MB --mode cache --prompt "ROMEO."

Runs on ``--device`` (default: CUDA where torch sees it, else the CPU; the first line says which
and why): the model's dense part and the fast tier. Prints what the store moved: bytes loaded into the fast tier (and read from disk), the time the
compute waited for data (stall), hit rates and the peak fast-tier bytes; ``--compare`` also runs
the in-memory model on the same tokens and reports whether the outputs are identical.

Every flag is checked before any work (numbers in range, ``--dir``/``--json`` writable, the
device present, the prompt within the model's context), and a failure is one line
``moeflow infer: error: ...`` on stderr: status 2 for a refused argument, 1 for a failure while
running (a damaged disk tier, ``moeflow.storage.disk.DiskTierError``, names the file and the
expert block). ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

from moeflow.cli.errors import UsageError, error_line
from moeflow.cli.flags import check_output_file, choose_device, env_threads, int_at_least, threads_help
from moeflow.cli.offload import (
    add_storage_flags,
    check_budget,
    expert_bytes,
    layout_line,
    storage_config,
    store_lines,
)

__all__ = ["add_infer"]

_PROG = "moeflow infer"


def add_infer(sub: argparse._SubParsersAction) -> None:
    from moeflow.models import GPT_PRESETS

    p = sub.add_parser(
        "infer",
        help="run the MoE GPT with experts offloaded (host/disk) through a fast-memory budget; report traffic",
        description="Build an MoE GPT (from a `moeflow train` checkpoint, or a random preset), move its expert "
        "weights to host memory or disk (--offload) and run a prefill plus greedy decoding with only "
        "--fast-memory bytes of experts resident: a ring of whole-layer slots with prefetch (--mode ring) "
        "or an LRU cache of the routed experts (--mode cache). Prints bytes moved, stall time and hit rates.",
    )
    p.add_argument("checkpoint", type=Path, nargs="?", default=None,
                   help="a `moeflow train` checkpoint (or its --out directory); default: a random --preset")
    p.add_argument("--preset", default="tiny", choices=sorted(GPT_PRESETS), help="random model size (default tiny)")
    p.add_argument("--vocab-size", type=int_at_least(2), default=256, help="with --preset (default 256)")
    p.add_argument("--layers", type=int_at_least(1), default=None, help="with --preset: override n_layers (default: the preset's)")
    add_storage_flags(p, offload_help="home tier of the experts (default disk)")
    p.add_argument("--batch-size", type=int_at_least(1), default=1, help="prompts decoded together (rows)")
    p.add_argument("--seq-len", type=int_at_least(1), default=None,
                   help="prompt length: prompt tokens per row (random tokens unless --prompt; default 32, at most the "
                   "model's context, max_seq_len; train's --seq-len is that context)")
    p.add_argument("--prompt", default=None, help="with a checkpoint that has a tokenizer: the prompt text (default: random tokens)")
    p.add_argument("--new-tokens", type=int_at_least(0), default=16, help="greedy decoding steps after the prefill")
    p.add_argument("--compare", action="store_true", help="also run the in-memory model; report time and equality")
    p.add_argument("--threads", type=int_at_least(1), default=None, help=threads_help(2, "torch threads"))
    p.add_argument("--seed", type=int_at_least(0), default=0, help="random weights and prompt tokens")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON (default: none)")
    p.set_defaults(func=run_infer)


def _fail(msg: object, status: int = 2) -> int:
    print(error_line(_PROG, msg), file=sys.stderr)
    return status


def _check_paths(args: argparse.Namespace) -> None:
    """``UsageError`` unless every path flag is usable (before any work)."""
    if args.checkpoint is not None and not args.checkpoint.exists():
        raise UsageError(f"checkpoint {args.checkpoint}: no such file or directory")
    if args.json is not None:
        check_output_file("--json", args.json)
    if args.seed >= 2**63:
        raise UsageError(f"--seed must be below 2**63, got {args.seed}")


def _build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(model, tokenizer or None, description)."""
    import torch

    from moeflow.models import MoEGPT, gpt_config

    if args.checkpoint is not None:
        from moeflow.train import build_from_checkpoint

        model, tok, _ = build_from_checkpoint(args.checkpoint)
        return model, tok, f"checkpoint {args.checkpoint}"
    overrides: dict = {"vocab_size": args.vocab_size}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    torch.manual_seed(args.seed)
    model = MoEGPT(gpt_config(args.preset, **overrides)).eval()
    return model, None, f"random preset {args.preset!r}"


def run_infer(args: argparse.Namespace) -> int:
    """The handler: ``_infer``, its refusals and run-time failures as one line (status 2 / 1)."""
    try:
        return _infer(args)
    except UsageError as err:
        if getattr(args, "debug", False):
            raise
        return _fail(err, err.status)
    except OSError as err:  # a damaged disk tier (DiskTierError), a full disk, an unwritable --json
        if getattr(args, "debug", False):
            raise
        return _fail(err, 1)


def _infer(args: argparse.Namespace) -> int:
    import torch

    _check_paths(args)
    device = choose_device("--device", args.device)  # CUDA where available
    args.device, args.device_line = device.device, device.line
    storage = storage_config(args)  # before any work: a bad value is one line and status 2
    args.threads = args.threads or env_threads() or 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, storage)
    finally:
        torch.set_num_threads(threads)  # a caller's setting (in-process use, tests) is left as it was


def _run(args: argparse.Namespace, storage) -> int:  # type: ignore[no-untyped-def]
    import torch

    from moeflow.checkpoint import CheckpointError
    from moeflow.storage import format_bytes, offload_experts

    try:
        model, tok, what = _build(args)
    except (CheckpointError, ValueError, TypeError) as err:
        return _fail(str(err))
    # every argument checked before the store writes anything
    if args.prompt is not None and tok is None:
        return _fail("--prompt needs a checkpoint with a tokenizer; without one the prompt is random tokens")
    cfg = model.config
    if args.seq_len is not None and args.seq_len > cfg.max_seq_len:
        return _fail(f"--seq-len {args.seq_len} is longer than the model's context (max_seq_len={cfg.max_seq_len})")
    gen = torch.Generator().manual_seed(args.seed)
    if args.prompt is not None:
        ids = tok.encode(args.prompt.replace("\\n", "\n")) or [0]
        if len(ids) > cfg.max_seq_len:
            return _fail(f"--prompt is {len(ids)} tokens, longer than the model's context (max_seq_len="
                         f"{cfg.max_seq_len})")
        idx = torch.tensor([ids] * args.batch_size)
    else:
        seq_len = args.seq_len if args.seq_len is not None else min(32, cfg.max_seq_len)
        idx = torch.randint(0, cfg.vocab_size, (args.batch_size, seq_len), generator=gen)
    idx = idx.to(args.device)
    model = model.to(args.device)
    reference = copy.deepcopy(model) if args.compare else None
    n_expert_bytes = expert_bytes(model)
    try:
        store = offload_experts(model, storage)
    except (ValueError, TypeError) as err:
        return _fail(str(err))

    def run(m):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = m(idx)
            t1 = time.perf_counter()
            out = m.generate(idx, args.new_tokens, temperature=0) if args.new_tokens else idx
            t2 = time.perf_counter()
        return logits, out, t1 - t0, t2 - t1

    try:
        with store:
            logits, out, prefill_s, decode_s = run(model)
            stats = store.stats
            layout = layout_line(store, storage)
            report = {
                "model": what, "n_layers": cfg.n_layers, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                "expert_bytes": n_expert_bytes, "fast_memory": storage.fast_memory, "offload": args.offload,
                "device": args.device,
                "mode": args.mode, "prefetch": args.prefetch, "layout": layout,
                "direct_io": store.disk.direct_io if store.disk is not None else None,
                "checksum": store.disk.checksum if store.disk is not None else None,
                "tokens": {"batch": idx.shape[0], "prompt": idx.shape[1], "new": args.new_tokens},
                "prefill_s": prefill_s, "decode_s": decode_s, "stats": stats.as_dict(),
            }
            if args.mode == "cache":
                report["prefetch_hits"] = store.prefetch_hits
    except RuntimeError as err:
        if isinstance(err.__cause__, OSError):  # a prefetch nobody waited for found the disk tier damaged
            raise err.__cause__ from None
        raise
    lines = [
        args.device_line,
        f"moeflow infer: MoE GPT ({what}): {cfg.n_layers} layers, {cfg.num_experts} experts, top-{cfg.top_k}; "
        f"expert weights {format_bytes(n_expert_bytes)} in {args.offload}"
        + (f" ({'O_DIRECT' if report['direct_io'] else 'buffered'} reads, {report['checksum']} checksums)"
           if args.offload == "disk" else ""),
        f"fast tier: {format_bytes(storage.fast_memory)} budget on {args.device}: {layout}, prefetch {args.prefetch} "
        f"(experts = {n_expert_bytes / storage.fast_memory:.1f}x the budget)",
        f"prefill: {idx.shape[0]} x {idx.shape[1]} tokens in {prefill_s * 1e3:.1f} ms; "
        f"decode: {args.new_tokens} tokens in {decode_s * 1e3:.1f} ms",
        *store_lines(store, storage),
    ]
    check_budget(store, storage)
    if reference is not None:
        ref_logits, ref_out, ref_prefill, ref_decode = run(reference)
        same = bool(torch.equal(ref_logits, logits) and torch.equal(ref_out, out))
        report.update(identical=same, in_memory_prefill_s=ref_prefill, in_memory_decode_s=ref_decode)
        lines.append(f"in memory: prefill {ref_prefill * 1e3:.1f} ms, decode {ref_decode * 1e3:.1f} ms "
                     f"(offloaded/in-memory {(prefill_s + decode_s) / max(ref_prefill + ref_decode, 1e-9):.2f}x); "
                     f"outputs identical: {'yes' if same else 'NO'}")
    if tok is not None and args.new_tokens:
        lines.append(f"sample: {tok.decode(out[0].tolist())!r}")
    print("\n".join(lines))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0

