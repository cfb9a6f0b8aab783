"""Preparing a token corpus (``moeflow prepare-data``): documents tokenized once, in parallel, into
checksummed flat token files and ``index.json``, which ``moeflow.train.tokens.TokenDataset``
memory-maps. This module defines the format; reading and sampling live in ``moeflow.train.tokens``.

``prepare(sources, tokenizer, out_dir)`` tokenizes the documents of ``moeflow.train.sources`` in
parallel worker processes, in document order, each document followed by the tokenizer's
end-of-document token (if it has one), into flat token files (``uint16`` when the vocabulary
fits, ``uint32`` otherwise) of at most ``shard_tokens`` tokens each, and writes ``index.json``:

    {"format": "moeflow-tokens/1", "tokenizer": {...}, "dtype": "uint16", "eod": 256,
     "sources": [...], "val_fraction": 0.01, "seed": 0, "skipped_empty": 0,
     "splits": {"train": {"tokens": N, "documents": n, "doc_ends": "train.docs.npy",
                          "shards": [{"file": "train-00000.bin", "tokens": n, "xxh3": "..."}], ...},
                "val": {...}}}

A document goes to the validation split when a hash of ``(seed, its index)`` falls below
``val_fraction``: deterministic, independent of the number of workers. ``doc_ends`` holds each
document's end offset (the token after its end-of-document token). Every file has an xxh3
checksum in the index.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from moeflow.train.data import ByteTokenizer, Tokenizer, tokenizer_from_dict
from moeflow.train.sources import DataError, Document, Documents

__all__ = ["FORMAT", "INDEX", "DataError", "file_xxh3", "prepare", "split_of", "token_dtype"]

FORMAT = "moeflow-tokens/1"
INDEX = "index.json"
_READ = 16 << 20  # checksum reads
_TASK_CHARS = 1 << 20  # text per tokenizing task


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every token id fits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def split_of(index: int, seed: int, val_fraction: float) -> str:
    """``"val"`` for a document whose hash of ``(seed, index)`` falls below ``val_fraction``."""
    if val_fraction <= 0:
        return "train"
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little")
    return "val" if h / 2**64 < val_fraction else "train"


def _xxh3():  # type: ignore[no-untyped-def]
    import xxhash

    return xxhash.xxh3_128()


# ----------------------------------------------------------------------------------- prepare

_worker_tok: Tokenizer | None = None


def _init_worker(desc: dict) -> None:
    global _worker_tok
    _worker_tok = tokenizer_from_dict(desc)


def _encode_doc(tok: Tokenizer, text: str) -> np.ndarray:
    """One document's tokens and its end-of-document token (if the tokenizer has one), in the
    shards' dtype (a compact array: cheap to hand back from a worker)."""
    ids = tok.encode_array(text)
    if tok.eod is not None:
        ids = np.append(ids, tok.eod)
    return ids.astype(token_dtype(tok.vocab_size), copy=False)


def _encode_task(texts: list[str]) -> list[np.ndarray]:
    assert _worker_tok is not None
    return [_encode_doc(_worker_tok, t) for t in texts]


def _tasks(docs: Iterable[Document], seed: int, val_fraction: float) -> Iterator[tuple[list[str], list[str], list[str]]]:
    """``(texts, splits, wheres)`` in chunks of about ``_TASK_CHARS`` characters, in order."""
    texts, splits, wheres, size = [], [], [], 0
    for i, doc in enumerate(docs):
        texts.append(doc.text)
        splits.append(split_of(i, seed, val_fraction))
        wheres.append(doc.where)
        size += len(doc.text)
        if size >= _TASK_CHARS:
            yield texts, splits, wheres
            texts, splits, wheres, size = [], [], [], 0
    if texts:
        yield texts, splits, wheres


class _SplitWriter:
    """Appends documents' tokens to one split's shard files, hashing as it writes."""

    def __init__(self, out: Path, name: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.name, self.dtype, self.shard_tokens = out, name, dtype, shard_tokens
        self.shards: list[dict] = []
        self.doc_ends: list[int] = []
        self.tokens = 0
        self._file = None
        self._hash = None
        self._in_shard = 0

    def _open(self) -> None:
        self._close()
        name = f"{self.name}-{len(self.shards):05d}.bin"
        self._file = open(self.out / name, "wb")  # noqa: SIM115 - closed in _close
        self._hash = _xxh3()
        self._in_shard = 0
        self.shards.append({"file": name, "tokens": 0, "xxh3": ""})

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self.shards[-1].update(tokens=self._in_shard, xxh3=self._hash.hexdigest())
            self._file = None

    def add(self, ids: np.ndarray) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        pos = 0
        while pos < arr.size:
            if self._file is None or self._in_shard >= self.shard_tokens:
                self._open()
            take = min(arr.size - pos, self.shard_tokens - self._in_shard)
            chunk = arr[pos : pos + take].tobytes()
            self._file.write(chunk)
            self._hash.update(chunk)
            self._in_shard += take
            pos += take
        self.tokens += arr.size
        self.doc_ends.append(self.tokens)

    def finish(self) -> dict | None:
        self._close()
        if not self.doc_ends:
            return None
        ends = np.asarray(self.doc_ends, dtype=np.int64)
        docs_file = f"{self.name}.docs.npy"
        np.save(self.out / docs_file, ends)
        return {"tokens": self.tokens, "documents": len(self.doc_ends), "doc_ends": docs_file,
                "doc_ends_xxh3": file_xxh3(self.out / docs_file), "shards": self.shards}


def file_xxh3(path: Path) -> str:
    """The xxh3-128 hex digest of a file, read in 16 MiB pieces (no file is held in memory)."""
    h = _xxh3()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def prepare(documents: Documents, tokenizer: Tokenizer, out_dir: str | os.PathLike, *, val_fraction: float = 0.0,
            seed: int = 0, workers: int | None = None, shard_tokens: int = 1 << 28,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenize ``documents`` into ``out_dir`` (module docstring); returns the index. ``workers``:
    tokenizing processes (default: the CPUs, but one for the byte tokenizer, which turns text
    into tokens faster than a worker could hand them back: ~250 M tokens/s in one process, ~50 M
    with two workers, docs/benchmarks.md); ``progress(documents, tokens)`` after every chunk.
    ``out_dir`` must not exist or be empty; the index is written last, so a directory without
    one is an unfinished preparation (``TokenDataset`` refuses it)."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be a positive int, got {shard_tokens!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty folder (prepare into a new one)")
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {name: _SplitWriter(out, name, dtype, shard_tokens) for name in ("train", "val")}
    if workers is None:
        workers = 1 if isinstance(tokenizer, ByteTokenizer) else os.cpu_count() or 1
    desc = tokenizer.to_dict()
    n_docs = n_tokens = 0
    try:
        tasks = _tasks(documents, seed, val_fraction)
        if workers > 1:
            # fork where there is one (as torch's DataLoader does): a spawned worker would import the
            # caller's __main__ again, which a script without a __main__ guard cannot survive; the
            # workers only tokenize (no torch ops, no threads of the parent are needed)
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=(desc,)) as pool:
                pending: list[tuple[list[str], list[str]]] = []

                def texts_only() -> Iterator[list[str]]:
                    for texts, splits, wheres in tasks:
                        pending.append((splits, wheres))
                        yield texts

                for encoded in pool.imap(_encode_task, texts_only()):
                    splits, _ = pending.pop(0)
                    n_docs, n_tokens = _write(writers, encoded, splits, n_docs, n_tokens, progress)
        else:
            for texts, splits, _ in tasks:
                encoded = [_encode_doc(tokenizer, t) for t in texts]
                n_docs, n_tokens = _write(writers, encoded, splits, n_docs, n_tokens, progress)
        splits_index = {name: w.finish() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w._close()
        shutil.rmtree(out, ignore_errors=True)
        raise
    if splits_index["train"] is None:
        shutil.rmtree(out, ignore_errors=True)
        raise DataError(f"no training documents in {', '.join(documents.sources)}"
                        + (f" (val_fraction={val_fraction} took them all)" if n_docs else ""))
    index = {"format": FORMAT, "tokenizer": desc, "dtype": dtype.name, "eod": tokenizer.eod,
             "sources": list(documents.sources), "files": list(documents.files), "val_fraction": val_fraction,
             "seed": seed, "skipped_empty": documents.skipped,
             "splits": {k: v for k, v in splits_index.items() if v is not None}}
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, out / INDEX)
    return index


def _write(writers: dict, encoded: list[np.ndarray], splits: list[str], n_docs: int, n_tokens: int,
           progress: Callable[[int, int], None] | None) -> tuple[int, int]:
    for ids, split in zip(encoded, splits):  # (a tokenizer without an end token: the documents follow each other)
        writers[split].add(ids)
        n_docs += 1
        n_tokens += ids.size
    if progress is not None:
        progress(n_docs, n_tokens)
    return n_docs, n_tokens
