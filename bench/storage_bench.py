"""Ring-memory inference from disk: prefetch vs synchronous loading vs all in memory.

    .venv/bin/python bench/storage_bench.py [--layers 8] [--threads 1] [--json bench/results/storage.json]

Also reachable as ``moeflow infer --bench``. What is measured: see ``moeflow.storage.bench``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeflow.storage.bench import StorageBenchConfig, format_storage_report, run_storage_bench


def main(argv: list[str] | None = None) -> int:
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
    report = run_storage_bench(cfg, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    print(format_storage_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
