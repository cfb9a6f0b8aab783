"""Generation with the experts offloaded to disk, moeflow vs Hugging Face accelerate, on the
same weights in one process, at the same memory budget.

A random Mixtral-shaped ``MoEGPT`` is exported with ``moeflow.convert.mixtral.gpt_to_hf`` (what
``moeflow convert --to-hf`` writes). ``--budget`` is a byte budget for expert weights (default:
the experts' bytes / ``--budget-ratio``, 4); the candidates generate greedily from the same
prompt (``--batch`` rows of ``--prompt-len`` random tokens, ``--new-tokens`` new ones):

    moeflow:disk-direct  MoEGPT with ``offload_experts(StorageConfig(offload="disk", mode="cache",
                     fast_memory=budget))``: an LRU cache of the routed experts with
                     routing-aware prefetch; the dense part in memory; reads with ``O_DIRECT``
                     (every load a device read)
    moeflow:disk-cached  the same with ``disk_reads="cached"``: reads through the page cache,
                     which is what accelerate's memory-mapped offload files get
    accelerate:disk  ``MixtralForCausalLM.from_pretrained(dir, device_map="auto", max_memory=
                     {"cpu": dense + budget}, offload_folder=...)``: accelerate's disk offload
                     (whole decoder layers that do not fit are memory-mapped from the offload
                     folder and loaded on each forward), the usual way to run a model larger
                     than memory with transformers; skipped with a message without accelerate
    moeflow:memory   the same MoEGPT in memory (the "within 2x of in memory" target)

The candidates take turns within each of ``--repeats`` rounds (fair under a fluctuating load);
medians of prefill and decode seconds are reported with tokens/s and the ratios, and every
candidate's greedy tokens are compared with in-memory moeflow's.

Peak process memory is measured independently of the store's own counter: each offloaded
candidate runs once more in a fresh process (``--rss-probe``) that samples ``/proc/self/statm``
every 0.5 ms while it generates; reported against ``dense + budget`` (the margin is what the
process holds beyond that: allocator slack, activations, the KV cache, file pages mapped by
accelerate).

    .venv/bin/python -m bench.generate_offload     # writes bench/results/generate_offload.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.generate import _first_difference, add_model_flags, build_model, load_hf, take_turns, write_report
from bench.generate import _run_hf as run_hf_clocked
from bench.common import RESULTS, child_env

__all__ = ["main", "run_offload_bench"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.generate_offload", description=__doc__.split("\n\n")[0])
    add_model_flags(p)  # the model of bench.generate
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget-ratio", type=float, default=4.0, help="expert bytes / budget (default 4)")
    p.add_argument("--budget", default=None, help="the expert budget in bytes or '12MiB' (overrides --budget-ratio)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-rss", action="store_true", help="skip the peak-memory probes (fresh processes)")
    p.add_argument("--rss-probe", default=None, help=argparse.SUPPRESS)  # internal: "candidate,dir,budget,out"
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    return p


def _model(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    return build_model(args, args.prompt_len + args.new_tokens)


def _sizes(model) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(expert bytes, dense bytes) of an in-memory model."""
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    return experts, dense


def _prompt(args: argparse.Namespace) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=gen)


def accelerate_missing() -> str | None:
    """Why the accelerate half cannot run, or ``None`` when it can."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return ("accelerate is not installed: skipping the accelerate disk-offload baseline "
                "(pip install -c constraints.txt 'moeflow[bench]')")
    return None


def _load_accelerate(hf_dir: Path, offload_dir: Path, max_cpu: int):  # type: ignore[no-untyped-def]
    return load_hf(hf_dir, device_map="auto", max_memory={"cpu": max_cpu}, offload_folder=str(offload_dir))


_DISK = {"moeflow:disk-direct": "direct", "moeflow:disk-cached": "cached"}  # candidate -> StorageConfig.disk_reads


def _offload_moeflow(model, budget: int, directory: Path, reads: str):  # type: ignore[no-untyped-def]
    from moeflow.storage import StorageConfig, offload_experts

    return offload_experts(model, StorageConfig(offload="disk", mode="cache", fast_memory=budget, prefetch=1,
                                                directory=directory, disk_reads=reads))


def _run_moeflow(model, idx_BS: torch.Tensor, n: int):  # type: ignore[no-untyped-def]
    from moeflow.models.generation import generate

    out = generate(model, idx_BS, n, temperature=0)
    return out.tokens, out.prefill_s, out.decode_s


def _run_hf(hf, idx_BS: torch.Tensor, n: int):  # type: ignore[no-untyped-def]
    return run_hf_clocked(hf, idx_BS, n, time.perf_counter)


def run_offload_bench(args: argparse.Namespace) -> dict:
    from moeflow.convert.mixtral import gpt_to_hf
    from moeflow.storage import parse_bytes

    torch.set_num_threads(args.threads)
    model = _model(args)
    expert_bytes, dense_bytes = _sizes(model)
    budget = parse_bytes(args.budget, "--budget") if args.budget is not None else int(expert_bytes / args.budget_ratio)
    idx = _prompt(args)
    n = args.new_tokens
    skipped = accelerate_missing()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-offload-") as tmp:
        tmp_path = Path(tmp)
        gpt_to_hf(model, tmp_path / "hf")
        offloaded = {name: copy.deepcopy(model) for name in _DISK}
        stores = {name: _offload_moeflow(offloaded[name], budget, tmp_path, reads) for name, reads in _DISK.items()}
        cands = {"moeflow:memory": lambda: _run_moeflow(model, idx, n)}
        for name in _DISK:
            cands[name] = lambda name=name: _run_moeflow(offloaded[name], idx, n)
        hf = None
        if skipped is None:
            hf = _load_accelerate(tmp_path / "hf", tmp_path / "offload", dense_bytes + budget)
            cands["accelerate:disk"] = lambda: _run_hf(hf, idx, n)
        else:
            print(skipped, file=sys.stderr)
        with stores["moeflow:disk-direct"], stores["moeflow:disk-cached"], torch.no_grad():
            for name, run in cands.items():  # warm-up (and the cache's first fill)
                run()
            for store in stores.values():
                store.reset_stats()
            medians, tokens = take_turns(cands, args.repeats)
            stats = {name: {**store.stats.as_dict(), "prefetch_hits": store.prefetch_hits} for name, store in stores.items()}
            cache_slots = stores["moeflow:disk-cached"].cache_slots
        hf_map = None
        if hf is not None:
            hf_map = {}
            for where in getattr(hf, "hf_device_map", {}).values():
                hf_map[str(where)] = hf_map.get(str(where), 0) + 1
            del hf
    B = args.batch
    for name, (pre, dec) in medians.items():
        rows.append({"candidate": name, "prefill_s": pre, "decode_s": dec, "prefill_tok_s": B * args.prompt_len / pre,
                     "decode_tok_s": B * (n - 1) / dec if dec else None,
                     "total_tok_s": B * n / (pre + dec),
                     "tokens_vs_in_memory": _first_difference(tokens["moeflow:memory"], tokens[name])})
    by = {r["candidate"]: r for r in rows}
    ratios = {}
    for name in _DISK:
        reads = _DISK[name]
        ratios[f"{reads}_vs_memory_total"] = by[name]["total_tok_s"] / by["moeflow:memory"]["total_tok_s"]
        if "accelerate:disk" in by:
            ratios[f"{reads}_vs_accelerate_total"] = by[name]["total_tok_s"] / by["accelerate:disk"]["total_tok_s"]
            ratios[f"{reads}_vs_accelerate_decode"] = by[name]["decode_tok_s"] / by["accelerate:disk"]["decode_tok_s"]
    report = {
        "bench": "generate_offload", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "dtype": "float32",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "accelerate": None if skipped else __import__("accelerate").__version__, "accelerate_skipped": skipped,
        "expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "budget": budget,
        "experts_over_budget": expert_bytes / budget, "cache_slots": cache_slots,
        "routed_experts_per_step": args.layers * min(args.experts, args.batch * args.top_k),
        "accelerate_device_map": hf_map, "moeflow_store": stats, "results": rows, "ratios": ratios,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if not args.no_rss:
        report["rss"] = {name: _rss(args, name, budget) for name in (*_DISK, "accelerate:disk")
                         if name != "accelerate:disk" or skipped is None}
        for probe in report["rss"].values():
            probe["margin_over_dense_plus_budget"] = probe["peak_generate"] - dense_bytes - budget
    _print(report)
    return report


def _rss(args: argparse.Namespace, name: str, budget: int) -> dict:
    """Peak resident bytes of ``name`` generating once, in a fresh process (see ``_probe``)."""
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-rss-") as tmp:
        out = Path(tmp) / "rss.json"
        argv = [sys.executable, "-m", "bench.generate_offload", *sys_args(args),
                "--rss-probe", f"{name},{tmp},{budget},{out}"]
        subprocess.run(argv, check=True, env=child_env())
        return json.loads(out.read_text())


def sys_args(args: argparse.Namespace) -> list[str]:
    flags = ("dim", "layers", "heads", "kv_heads", "experts", "top_k", "hidden", "vocab", "prompt_len", "new_tokens",
             "batch", "threads", "init_std", "seed")
    return [x for f in flags for x in (f"--{f.replace('_', '-')}", str(getattr(args, f)))]


def _probe(args: argparse.Namespace) -> None:
    """In a fresh process: build the candidate (the full model exists while it is built, as
    in any loader that reads a checkpoint), let the allocator settle, then sample the resident
    set every 0.5 ms while it generates; write the peak above the empty process's."""
    import ctypes
    import gc
    import os
    import threading

    from moeflow.convert.mixtral import gpt_to_hf

    name, tmp, budget_s, out = args.rss_probe.split(",")
    budget = int(budget_s)
    torch.set_num_threads(args.threads)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    libc = ctypes.CDLL("libc.so.6")

    def settle() -> None:
        gc.collect()
        libc.malloc_trim(0)

    settle()
    rss0 = rss()
    model = _model(args)
    _, dense_bytes = _sizes(model)
    idx = _prompt(args)
    store = None
    if name in _DISK:
        store = _offload_moeflow(model, budget, Path(tmp), _DISK[name])
        run = lambda: _run_moeflow(model, idx, args.new_tokens)
    else:
        gpt_to_hf(model, Path(tmp) / "hf")
        del model
        settle()
        hf = _load_accelerate(Path(tmp) / "hf", Path(tmp) / "offload", dense_bytes + budget)
        run = lambda: _run_hf(hf, idx, args.new_tokens)
    settle()
    before = rss()
    peak = [before]
    stop = [False]

    def sample() -> None:
        while not stop[0]:
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    with torch.no_grad():
        run()
    stop[0] = True
    thread.join()
    Path(out).write_text(json.dumps({"before_generate": before - rss0, "peak_generate": peak[0] - rss0,
                                     "budget": budget, "dense_bytes": dense_bytes,
                                     "store_peak": store.stats.peak_fast_bytes if store is not None else None}))
    if store is not None:
        store.close()


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _print(report: dict) -> None:
    print(f"experts {_mib(report['expert_bytes'])} = {report['experts_over_budget']:.1f}x the budget "
          f"{_mib(report['budget'])} ({report['cache_slots']} cache slots; {report['routed_experts_per_step']} routed "
          f"experts a step); dense part {_mib(report['dense_bytes'])}")
    for r in report["results"]:
        print(f"  {r['candidate']:16s} prefill {r['prefill_tok_s']:9.1f} tok/s  decode {r['decode_tok_s']:8.1f} tok/s  "
              f"total {r['total_tok_s']:8.1f} tok/s  tokens: {r['tokens_vs_in_memory']}")
    print("  ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["ratios"].items()))
    for name, s in report["moeflow_store"].items():
        print(f"  {name} store: read from disk {_mib(s['bytes_from_disk'])}, hit rate {s['hit_rate']:.1%} "
              f"({s['prefetch_hits']} prefetched), peak fast-tier {_mib(s['peak_fast_bytes'])}")
    if report["accelerate_skipped"]:
        print(f"  {report['accelerate_skipped']}")
    for name, p in report.get("rss", {}).items():
        print(f"  peak RSS while generating, {name}: {_mib(p['peak_generate'])} (dense + budget "
              f"{_mib(p['dense_bytes'] + p['budget'])}, margin {_mib(p['margin_over_dense_plus_budget'])})")


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rss_probe is not None:
        _probe(args)
        return 0
    if args.json is None:
        args.json = default_json
    write_report(run_offload_bench(args), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "generate_offload.json"))
