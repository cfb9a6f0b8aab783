"""One Hugging Face MoE block, transformers' experts implementations vs moeflow, in one process.

For a Mixtral-like block (few large experts) and a DeepSeek-V3-like block (many small experts,
group-limited sigmoid routing, a shared expert), times the forward (no grad) and the
forward+backward (training mode) of:

    eager         transformers' per-expert loop (experts_implementation="eager")
    grouped_mm    transformers' grouped GEMM path
    batched_mm    transformers' per-token batched GEMM (skipped when its per-token weight
                  copies would exceed --batched-mm-max-gb)
    moeflow       the "moeflow" experts implementation (moeflow.integrations.hf)
    moeflow_patch the block replaced by moeflow.integrations.hf.patch

on the same block (same parameters and input), median of --repeats timed runs after --warmup
runs, the candidates taking turns within each repeat (fair under a fluctuating load). Prints a
table (median ms with the minimum in parentheses, and the ratio of medians eager/candidate: > 1
is faster than eager) and writes JSON.

    .venv/bin/python -m bench.hf            # writes bench/results/hf_bench.json


Allocator: with glibc's default settings, the large activations of a 2048-token block are
mmapped and returned to the OS on every call, and the page faults that follow swamp the matmuls
(fwd+bwd of the DeepSeek-like block measured 3-6 s instead of ~0.35 s, for every candidate).
``--malloc tuned`` (default) raises glibc's trim threshold to 1 GiB and fixes the mmap threshold
at 32 MiB (the ceiling glibc's own adaptive threshold reaches) through ``mallopt``, for all
candidates alike, as tcmalloc/jemalloc would; ``--malloc default`` leaves glibc alone.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers
from torch import nn

from moeflow.integrations import hf
from bench.common import RESULTS

IMPLS = ["eager", "grouped_mm", "batched_mm", "moeflow", "moeflow_patch"]


def tune_glibc_malloc() -> bool:
    """Keep freed heap memory in the process (see the module docstring); False if not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
    return bool(libc.mallopt(m_trim_threshold, 1 << 30)) and bool(libc.mallopt(m_mmap_threshold, 32 << 20))


def make_block(kind: str, args: argparse.Namespace) -> tuple[nn.Module, str, int, int]:
    """A randomly initialised HF MoE block in a container (so ``patch`` can replace it).
    Returns ``(container, family, top_k, expert hidden)``."""
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            hidden_size=args.dim, intermediate_size=args.hidden, num_local_experts=8, num_experts_per_tok=2,
            experts_implementation="eager",
        )
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
        family, k, h = "mixtral", 2, args.hidden
    elif kind == "deepseek_v3":
        h = args.hidden // 4
        config = transformers.DeepseekV3Config(
            hidden_size=args.dim, moe_intermediate_size=h, n_routed_experts=64, num_experts_per_tok=6,
            n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
            experts_implementation="eager",
        )
        block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config)
        family, k = "deepseek_v3", 6
    else:
        raise ValueError(f"kind must be 'mixtral' or 'deepseek_v3', got {kind!r}")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.01)
    return nn.ModuleDict({"mlp": block}), family, k, h


def interleaved_times_ms(fns: dict[str, object], warmup: int, repeats: int) -> dict[str, tuple[float, float]]:
    """``(median, min)`` wall time of each callable; the repeats go round-robin over the candidates so a
    change in the load of a shared machine hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def bench_one(kind: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    base, family, k, h = make_block(kind, args)
    x = torch.randn(1, args.tokens, args.dim)
    E = base["mlp"].experts.num_experts
    row = {"kind": kind, "tokens": args.tokens, "dim": args.dim, "hidden": h, "experts": E, "top_k": k, "impl": {}}
    blocks: dict[str, nn.Module] = {}
    for impl in IMPLS:
        if impl == "batched_mm":
            # each of the T*K assignments gathers its expert's gate_up and down weights
            gb = args.tokens * k * 3 * args.dim * h * 4 / 1e9
            if gb > args.batched_mm_max_gb:
                row["impl"][impl] = {"skipped": f"needs ~{gb:.0f} GB of per-token weight copies"}
                continue
        model = copy.deepcopy(base)
        if impl == "moeflow_patch":
            hf.patch(model, family=family)
        else:
            model["mlp"].experts.config._experts_implementation = impl
        blocks[impl] = model["mlp"]

    def fwd(block: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            out = block(x)
        return out[0] if isinstance(out, tuple) else out

    def fwd_bwd(block: nn.Module) -> None:
        out = block(x.detach().requires_grad_())
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        block.zero_grad(set_to_none=True)

    for block in blocks.values():
        block.eval()
    ref_y = fwd(blocks["eager"])
    errs = {impl: float((fwd(b) - ref_y).abs().max() / ref_y.abs().max()) for impl, b in blocks.items()}
    f_ms = interleaved_times_ms({i: (lambda b=b: fwd(b)) for i, b in blocks.items()}, args.warmup, args.repeats)
    for block in blocks.values():
        block.train()
    fb_ms = interleaved_times_ms({i: (lambda b=b: fwd_bwd(b)) for i, b in blocks.items()}, args.warmup, args.repeats)
    for impl in blocks:
        row["impl"][impl] = {
            "forward_ms": f_ms[impl][0], "forward_min_ms": f_ms[impl][1],
            "fwd_bwd_ms": fb_ms[impl][0], "fwd_bwd_min_ms": fb_ms[impl][1],
            "rel_err_vs_eager": errs[impl],
        }
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| block | impl | forward ms (min) | vs eager | fwd+bwd ms (min) | vs eager | rel err vs eager |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = f"{r['kind']} T={r['tokens']} D={r['dim']} H={r['hidden']} E={r['experts']} K={r['top_k']}"
        eager = r["impl"]["eager"]
        for impl in IMPLS:
            m = r["impl"].get(impl)
            if m is None:
                continue
            if "skipped" in m:
                lines.append(f"| {name} | {impl} | skipped: {m['skipped']} | | | | |")
                continue
            lines.append(
                f"| {name} | {impl} | {m['forward_ms']:.1f} ({m['forward_min_ms']:.1f}) | "
                f"{eager['forward_ms'] / m['forward_ms']:.2f}x | {m['fwd_bwd_ms']:.1f} ({m['fwd_bwd_min_ms']:.1f}) | "
                f"{eager['fwd_bwd_ms'] / m['fwd_bwd_ms']:.2f}x | {m['rel_err_vs_eager']:.1e} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, default_json: Path | None = None) -> None:
    """Run the benchmark with the command-line flags ``argv``; ``default_json`` is where the
    report goes when ``--json`` is not given (nowhere when it is None)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024, help="Mixtral expert hidden; DeepSeek-like uses hidden/4")
    parser.add_argument("--blocks", nargs="+", default=["mixtral", "deepseek_v3"], choices=["mixtral", "deepseek_v3"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batched-mm-max-gb", type=float, default=2.0)
    parser.add_argument("--malloc", choices=["tuned", "default"], default="tuned", help="see the module docstring")
    parser.add_argument("--json", type=Path, default=default_json,
                        help="write the JSON report here" + ("" if default_json is None else f" (default {default_json})"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    torch.set_num_threads(args.threads)
    malloc = "default"
    if args.malloc == "tuned":
        if not tune_glibc_malloc():
            parser.error("--malloc tuned needs glibc (libc.so.6 with mallopt); pass --malloc default")
        malloc = "glibc mallopt: M_TRIM_THRESHOLD=1GiB, M_MMAP_THRESHOLD=32MiB"
    rows = [bench_one(kind, args) for kind in args.blocks]
    print(table(rows))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": "float32",
        "malloc": malloc,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "statistic": "median",
        "rows": rows,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "hf_bench.json"))
