"""Benchmark of ring-memory inference from disk: prefetch vs synchronous loading vs in memory.

The model is a ``MoEGPT`` with ``n_layers`` MoE layers and a fast-tier budget of two ring slots
(one layer computing, the next loading), so its expert weights are ``n_layers / 2`` times the
budget (4x by default). The weights are written to a safetensors file with page-aligned tensors
and read back with ``O_DIRECT`` (no page cache: every load is a real read of the disk, as when
the weights are far larger than RAM; where the file system has no ``O_DIRECT``, buffered reads
with the page cache dropped after each one, ``POSIX_FADV_DONTNEED``). Three runs of the same
forward pass (``B x S`` random tokens):

- ``in-memory``: the plain model, every expert weight resident (the floor);
- ``sync``: ring of the same budget, ``prefetch=0``: each layer loads when it is needed;
- ``prefetch``: ring with ``prefetch=1``: layer ``l + 1`` loads while layer ``l`` computes;
- ``sync_unchecked`` / ``prefetch_unchecked``: the same two with ``verify_checksums=False``, so
  the cost of checking every expert block read from disk (``moeflow.storage.checksum``) is the
  ratio checked / unchecked: exposed in ``sync``, overlapped with compute in ``prefetch``.

All runs of a regime are timed interleaved (each repeat runs every model once, in a rotating
order), so a machine that gets busier or quieter during the run shifts them alike; the times
are medians. The report also gives each checksum's throughput on this machine (GB/s, one core).

Two regimes: ``balanced`` (token count calibrated so one layer's compute takes about as long as
one layer's load) and ``compute-bound`` (``compute_factor`` times more tokens). Outputs of the
three runs are compared with ``torch.equal`` (same math, same bits).

Run it with ``python -m bench.storage`` (flags: ``main``) or ``moeflow infer --bench``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moeflow.config import _float, _int
from moeflow.storage import StorageConfig, checksum, format_bytes, offload_experts, slot_bytes

__all__ = ["StorageBenchConfig", "run_storage_bench", "format_storage_report", "run_and_report", "main"]

# store name -> (prefetch, verify_checksums)
_STORES = {"sync": (0, True), "prefetch": (1, True), "sync_unchecked": (0, False), "prefetch_unchecked": (1, False)}


@dataclass(frozen=True, kw_only=True)
class StorageBenchConfig:
    """Shape of the benchmark model and how it is timed (see the module docstring)."""

    n_layers: int = 8
    dim: int = 512
    hidden: int = 1024
    experts: int = 8
    top_k: int = 2
    heads: int = 8
    seq_len: int = 128
    repeats: int = 5
    threads: int = 1  # on 2 cores, the other core serves the copy thread
    balanced_tokens: int | None = None
    compute_factor: float = 4.0
    evict_page_cache: bool = True
    directory: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "dim", "hidden", "experts", "top_k", "heads", "seq_len", "repeats", "threads"):
            _int(name, getattr(self, name), minimum=1)
        _float("compute_factor", self.compute_factor, minimum=1.0)
        if self.balanced_tokens is not None:
            _int("balanced_tokens", self.balanced_tokens, minimum=1)
        if self.n_layers < 4:
            raise ValueError(f"n_layers must be >= 4 (two ring slots hold 2 layers; the model must be larger "
                             f"than the fast tier), got {self.n_layers}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time(fn, repeats: int, warmup: int = 2) -> tuple[float, torch.Tensor]:
    for _ in range(warmup):  # first calls pay allocator and first-touch costs; fills the ring
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _time_interleaved(fns: dict, repeats: int, warmup: int = 2) -> dict[str, tuple[float, torch.Tensor]]:
    """name -> (median seconds, last output) of ``fns``, timed interleaved: after ``warmup``
    calls of each, every repeat calls each once, the order rotating from repeat to repeat."""
    names, out, times = list(fns), {}, {name: [] for name in fns}
    for name in names:
        for _ in range(warmup):
            out[name] = fns[name]()
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            out[name] = fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(times[name]), out[name]) for name in names}


def checksum_throughput(nbytes: int = 32 << 20, repeats: int = 5) -> dict[str, float]:
    """GB/s of each checksum this process can compute (``moeflow.storage.checksum``) over a
    random ``nbytes`` buffer (larger than the caches, as a slot is), median of ``repeats``."""
    import numpy as np

    buf = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    out = {}
    for name, fn in checksum.algorithms().items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(buf)
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times) / 1e9
    return out


def run_storage_bench(cfg: StorageBenchConfig, progress=lambda msg: None) -> dict:  # type: ignore[no-untyped-def]
    """Run the benchmark; returns a JSON-able report (see ``format_storage_report``). Runs with
    ``cfg.threads`` torch threads and restores the caller's setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run_storage_bench(cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _run_storage_bench(cfg: StorageBenchConfig, progress) -> dict:  # type: ignore[no-untyped-def]
    from moeflow.layer import moe_layers
    from moeflow.models import MoEGPT, gpt_config

    torch.manual_seed(cfg.seed)
    model_cfg = gpt_config("tiny", vocab_size=256, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.heads,
                           num_experts=cfg.experts, top_k=cfg.top_k, expert_hidden=cfg.hidden,
                           max_seq_len=cfg.seq_len)
    ref = MoEGPT(model_cfg).eval()
    expert_bytes = sum(p.numel() * p.element_size() for n, p in ref.named_parameters() if ".experts." in n)
    budget = 2 * slot_bytes(moe_layers(ref)[0].experts)
    progress(f"model: {cfg.n_layers} MoE layers, expert weights {format_bytes(expert_bytes)}, "
             f"fast budget {format_bytes(budget)}")
    stores, models = {}, {}
    try:
        for name, (prefetch, verify) in _STORES.items():
            models[name] = copy.deepcopy(ref)
            stores[name] = offload_experts(models[name], StorageConfig(
                offload="disk", fast_memory=budget, prefetch=prefetch, evict_page_cache=cfg.evict_page_cache,
                verify_checksums=verify, directory=None if cfg.directory is None else f"{cfg.directory}/{name}",
            ))
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    slots = stores["prefetch"].num_slots
    direct_io = stores["prefetch"].disk.direct_io  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    try:
        with torch.no_grad():
            # calibration: time of one forward's loads (sync ring, one short sequence: load-bound)
            tiny = torch.randint(0, 256, (1, 8), generator=gen)
            load_s, _ = _time(lambda: models["sync"](tiny), 3)
            base_tokens = 2 * cfg.seq_len
            idx = torch.randint(0, 256, (base_tokens // cfg.seq_len, cfg.seq_len), generator=gen)
            compute_s, _ = _time(lambda: ref(idx), 3, warmup=3)
            per_token = compute_s / base_tokens
            balanced = cfg.balanced_tokens or max(cfg.seq_len, round(load_s / per_token / cfg.seq_len) * cfg.seq_len)
            progress(f"calibration: loads {load_s * 1e3:.0f} ms per forward, compute {per_token * 1e6:.0f} us per token "
                     f"-> balanced at {balanced} tokens")
            regimes = []
            for regime, tokens in (("balanced", balanced),
                                   ("compute-bound", round(balanced * cfg.compute_factor / cfg.seq_len) * cfg.seq_len)):
                idx = torch.randint(0, 256, (max(1, tokens // cfg.seq_len), cfg.seq_len), generator=gen)
                row = {"regime": regime, "tokens": idx.numel()}
                for store in stores.values():
                    store.reset_stats()
                verify_s0 = {name: store.disk.verify_s for name, store in stores.items()}
                fns = {"in_memory": lambda idx=idx: ref(idx)}
                fns.update({name: (lambda m=models[name], idx=idx: m(idx)) for name in _STORES})
                timed = _time_interleaved(fns, cfg.repeats)
                outs = {name: out for name, (_, out) in timed.items()}
                row["in_memory_s"] = timed["in_memory"][0]
                calls = cfg.repeats + 2
                for name, store in stores.items():
                    row[f"{name}_s"] = timed[name][0]
                    row[f"{name}_stall_s"] = store.stats.stall_s / calls
                    row[f"{name}_bytes_loaded"] = store.stats.bytes_loaded / calls
                    row[f"{name}_peak_fast_bytes"] = store.stats.peak_fast_bytes
                    row[f"{name}_hit_rate"] = store.stats.hit_rate
                row["identical"] = all(torch.equal(outs["in_memory"], outs[name]) for name in _STORES)
                row["speedup_prefetch_vs_sync"] = row["sync_s"] / row["prefetch_s"]
                row["prefetch_over_in_memory"] = row["prefetch_s"] / row["in_memory_s"]
                # the checksums' cost: checked / unchecked - 1 (negative: below the noise)
                row["checksum_cost_sync"] = row["sync_s"] / row["sync_unchecked_s"] - 1
                row["checksum_cost_prefetch"] = row["prefetch_s"] / row["prefetch_unchecked_s"] - 1
                # the copy thread's seconds spent checking, per forward: what a synchronous load
                # adds to the step at most (less noisy than the difference of two medians)
                row["verify_s"] = (stores["sync"].disk.verify_s - verify_s0["sync"]) / calls
                row["verify_over_step"] = row["verify_s"] / row["prefetch_s"]
                progress(f"{regime}: {row['tokens']} tokens, in-memory {row['in_memory_s'] * 1e3:.0f} ms, "
                         f"sync {row['sync_s'] * 1e3:.0f} ms, prefetch {row['prefetch_s'] * 1e3:.0f} ms; "
                         f"unchecked sync {row['sync_unchecked_s'] * 1e3:.0f} ms, "
                         f"prefetch {row['prefetch_unchecked_s'] * 1e3:.0f} ms")
                regimes.append(row)
    finally:
        for store in stores.values():
            store.close()
    return {
        "config": asdict(cfg),
        "machine": f"{_cpu_name()} ({os.cpu_count()} cores), {torch.get_num_threads()} torch thread(s), "
                   f"torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dtype": "float32",
        "expert_bytes": expert_bytes,
        "fast_budget": budget,
        "direct_io": direct_io,
        "ring_slots": slots,
        "calibration": {"load_s_per_forward": load_s, "compute_s_per_token": per_token},
        "checksum": checksum.ALGORITHM,
        "checksum_gb_per_s": checksum_throughput(),
        "regimes": regimes,
    }


def format_storage_report(report: dict) -> str:
    c = report["config"]
    lines = [
        f"ring-memory inference from disk ({report['date']}; {report['machine']}; {report['dtype']})",
        f"model: MoEGPT {c['n_layers']} MoE layers, D={c['dim']}, H={c['hidden']}, E={c['experts']}, K={c['top_k']}; "
        f"expert weights {format_bytes(report['expert_bytes'])} = {report['expert_bytes'] / report['fast_budget']:.1f}x "
        f"the fast budget {format_bytes(report['fast_budget'])} ({report['ring_slots']} ring slots)",
        f"disk reads: {'O_DIRECT (no page cache)' if report['direct_io'] else 'buffered'}"
        f"{', page cache dropped after each read' if c['evict_page_cache'] and not report['direct_io'] else ''}; "
        f"calibrated load time {report['calibration']['load_s_per_forward'] * 1e3:.0f} ms per forward",
        f"checksums: {report['checksum']} on every block read; throughput on this machine: "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in report["checksum_gb_per_s"].items()),
        "",
        f"{'regime':<14}{'tokens':>7}{'in-mem ms':>11}{'sync ms':>9}{'prefetch ms':>13}{'sync/pref':>11}"
        f"{'pref/in-mem':>13}{'stall ms sync/pref':>20}{'loaded/fwd':>12}{'equal':>7}",
    ]
    for r in report["regimes"]:
        lines.append(
            f"{r['regime']:<14}{r['tokens']:>7}{r['in_memory_s'] * 1e3:>11.1f}{r['sync_s'] * 1e3:>9.1f}"
            f"{r['prefetch_s'] * 1e3:>13.1f}{r['speedup_prefetch_vs_sync']:>10.2f}x{r['prefetch_over_in_memory']:>12.2f}x"
            f"{r['sync_stall_s'] * 1e3:>11.1f} / {r['prefetch_stall_s'] * 1e3:<6.1f}"
            f"{format_bytes(r['prefetch_bytes_loaded']):>12}{'yes' if r['identical'] else 'NO':>7}"
        )
    lines.append("")
    lines.append(f"{'checksum cost':<14}{'sync ms':>9}{'unchecked':>11}{'cost':>8}{'prefetch ms':>13}{'unchecked':>11}"
                 f"{'cost':>8}{'check ms/fwd':>14}{'/ step':>8}")
    for r in report["regimes"]:
        lines.append(
            f"{r['regime']:<14}{r['sync_s'] * 1e3:>9.1f}{r['sync_unchecked_s'] * 1e3:>11.1f}"
            f"{r['checksum_cost_sync']:>+8.1%}{r['prefetch_s'] * 1e3:>13.1f}{r['prefetch_unchecked_s'] * 1e3:>11.1f}"
            f"{r['checksum_cost_prefetch']:>+8.1%}{r['verify_s'] * 1e3:>14.1f}{r['verify_over_step']:>8.1%}"
        )
    lines.append("targets: balanced sync/pref >= 1.5x; compute-bound pref/in-mem <= 1.3x; checksum cost < 5% of "
                 "the step; times are medians of the repeats, interleaved; stall = time the compute thread waited "
                 "for a load")
    return "\n".join(lines)


def run_and_report(cfg: StorageBenchConfig, json_path: Path | None) -> None:
    """Run the benchmark (progress on stderr), print the table and, if ``json_path`` is
    given, write the report there as JSON."""
    report = run_storage_bench(cfg, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    print(format_storage_report(report))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}")


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.storage [--layers 8] [--threads 1] [--json PATH]``; returns the
    exit status (2 for an invalid configuration, named on stderr)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", dest="n_layers", type=int, default=8,
                   help="MoE layers; the fast budget is 2 of them, so expert bytes = layers/2 x budget")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on 2 cores the other one serves the copy thread)")
    p.add_argument("--balanced-tokens", type=int, default=None, help="skip the calibration")
    p.add_argument("--compute-factor", type=float, default=4.0)
    p.add_argument("--keep-page-cache", dest="evict_page_cache", action="store_false")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k != "json"}
    try:
        cfg = StorageBenchConfig(**flags)
    except (TypeError, ValueError) as err:
        print(f"storage_bench: error: {err}", file=sys.stderr)
        return 2
    run_and_report(cfg, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
