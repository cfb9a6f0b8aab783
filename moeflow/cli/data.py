"""``moeflow prepare-data``: tokenize a corpus once into memory-mappable token shards
(``moeflow.train.prepare.prepare``), for ``moeflow train --data DIR``.

    moeflow prepare-data corpus/ more.jsonl --tokenizer byte --out data/prepared --val-fraction 0.01
    moeflow prepare-data books.parquet --tokenizer path/to/tokenizer.json --out data/books --workers 8
    moeflow prepare-data notes/ --out data/notes          # then: moeflow train --data data/notes

Its defaults are ``moeflow train``'s, so that the two compose: the validation split
``train --data OUT`` needs, of the share ``train`` holds out of raw sources (``--val-fraction``),
with at least one window of train's default ``--seq-len`` in each split (``--min-val-tokens``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moeflow.cli.errors import UsageError
from moeflow.cli.flags import int_at_least

__all__ = ["add_prepare_data"]


def add_prepare_data(sub: argparse._SubParsersAction) -> None:
    from moeflow.train.prepare import DEFAULT_MIN_VAL_TOKENS, DEFAULT_VAL_FRACTION

    p = sub.add_parser(
        "prepare-data", help="tokenize your corpus once into token shards for `moeflow train --data`",
        description="Read the documents of SOURCEs (text files or folders of them, .jsonl / .json with the text in "
        "--text-field, .parquet, a datasets directory written by save_to_disk, hf:NAME from the local datasets "
        "cache), tokenize them in parallel, each followed by an end-of-document token, and write flat token files "
        "(uint16 when the vocabulary fits, else uint32) and index.json (tokenizer, counts, document ends, "
        "checksums) into --out. `moeflow train --data OUT` memory-maps them.")
    p.add_argument("sources", nargs="+", metavar="SOURCE")
    p.add_argument("--out", type=Path, required=True, help="a new (or empty) folder for the shards")
    p.add_argument("--tokenizer", default="byte", metavar="byte|bpe|PATH",
                   help="UTF-8 bytes (and an end-of-document token), a BPE trained on these documents, or a Hugging "
                   "Face tokenizer.json / model directory")
    p.add_argument("--bpe-vocab", type=int_at_least(257), default=1024, help="with --tokenizer bpe: the vocabulary size")
    p.add_argument("--text-field", default="text", help="the JSON key or column holding the text")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help="the share held out into a validation split (as `moeflow train` holds out of raw sources): "
                   "whole documents chosen by a hash of their index (deterministic), or, when that leaves a split "
                   "shorter than --min-val-tokens (too few documents), the last tokens of the corpus; 0: no "
                   "validation split (`moeflow train --data OUT` then needs --val-data)")
    p.add_argument("--min-val-tokens", type=int_at_least(1), default=DEFAULT_MIN_VAL_TOKENS, metavar="N",
                   help="the fewest tokens each split keeps when holding out: one window of the training run, its "
                   "--seq-len + 2 (the default is train's default --seq-len 128)")
    p.add_argument("--seed", type=int, default=0, help="which documents --val-fraction holds out")
    p.add_argument("--workers", type=int_at_least(1), default=None, help="tokenizing processes (default: the CPUs; 1 for --tokenizer byte, which is faster in one)")
    p.add_argument("--shard-tokens", type=int_at_least(1), default=1 << 28, help="tokens per shard file at most")
    p.add_argument("--skip-empty", action="store_true", help="skip empty documents (counted) instead of refusing them")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from moeflow.train.data import BPETokenizer, ByteTokenizer, load_tokenizer
    from moeflow.train.sources import documents
    from moeflow.train.prepare import prepare, split_note

    if not 0 <= args.val_fraction < 1:
        raise UsageError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    for source in args.sources:
        if not source.startswith("hf:") and not Path(source).exists():
            raise UsageError(f"{source}: no such file or folder")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise UsageError(f"--out {args.out}: exists and is not an empty folder (prepare into a new one)")
    docs = documents(args.sources, text_field=args.text_field, skip_empty=args.skip_empty)
    if args.tokenizer == "byte":
        tok = ByteTokenizer(encoding="utf-8", eod=True)
    elif args.tokenizer == "bpe":
        tok = BPETokenizer.train((d.text for d in docs), args.bpe_vocab, eod=True)  # streamed
    else:
        tok = load_tokenizer(args.tokenizer)
    bar = None
    if args.progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit=" tok", unit_scale=True, desc="tokenizing", file=sys.stderr)
    seen = [0]

    def progress(n_docs: int, n_tokens: int) -> None:
        if bar is not None:
            bar.update(n_tokens - seen[0])
            bar.set_postfix(documents=n_docs)
        seen[0] = n_tokens

    t0 = time.perf_counter()
    index = prepare(docs, tok, args.out, val_fraction=args.val_fraction, min_val_tokens=args.min_val_tokens,
                    seed=args.seed, workers=args.workers, shard_tokens=args.shard_tokens, progress=progress)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    total = sum(v["tokens"] for v in index["splits"].values())
    for name, split in index["splits"].items():
        print(f"{name}: {split['documents']:,} documents, {split['tokens']:,} tokens, {len(split['shards'])} shard(s)")
    print(split_note(index))
    if index["skipped_empty"]:
        print(f"skipped {index['skipped_empty']:,} empty documents (--skip-empty)")
    print(f"{total:,} tokens ({index['dtype']}, vocabulary {tok.vocab_size:,}) in {seconds:.1f} s "
          f"({total / max(seconds, 1e-9):,.0f} tokens/s) -> {args.out}")
    return 0
