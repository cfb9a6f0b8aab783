"""Preparing a token corpus (``moeflow prepare-data``): documents tokenized once, in parallel, into
checksummed flat token files and ``index.json``, which ``moeflow.train.tokens.TokenDataset``
memory-maps. This module defines the format; reading and sampling live in ``moeflow.train.tokens``.

``prepare(sources, tokenizer, out_dir)`` tokenizes the documents of ``moeflow.train.sources`` in
parallel worker processes, in document order, each document followed by the tokenizer's
end-of-document token (if it has one), into flat token files (``uint16`` when the vocabulary
fits, ``uint32`` otherwise) of at most ``shard_tokens`` tokens each, and writes ``index.json``:

    {"format": "moeflow-tokens/1", "tokenizer": {...}, "dtype": "uint16", "eod": 256,
     "sources": [...], "documents": 3, "val_fraction": 0.05, "val_split": "tokens",
     "min_val_tokens": 130, "seed": 0, "skipped_empty": 0,
     "splits": {"train": {"tokens": N, "documents": n, "doc_ends": "train.docs.npy",
                          "shards": [{"file": "train-00000.bin", "tokens": n, "xxh3": "..."}], ...},
                "val": {...}}}

The validation split (``val_split``) holds out ``val_fraction`` of the corpus:

- ``"documents"``: a document goes to it when a hash of ``(seed, its index)`` falls below
  ``val_fraction``: deterministic, independent of the number of workers. Whole documents keep
  validation text unseen in training, the usual hold-out of a corpus of many documents.
- ``"tokens"``: when that leaves either split shorter than ``min_val_tokens`` (one training
  window: too few documents, as in a folder of three files, or the hash chose none), the last
  ``max(round(val_fraction * N), min_val_tokens)`` tokens of the corpus in document order
  instead. Two disjoint stretches, so no training window can overlap a validation token; the
  corpus' tail rather than each document's, because a cut per document would need every
  document to be longer than a window and would leave training windows running from one
  document's head into the next's. Too few tokens for a window in each split is an error
  naming the sources and the sizes.
- ``"none"``: ``val_fraction`` 0. An index without ``val_split`` (an older preparation) was
  split by documents.

``doc_ends`` holds each document's end offset in its split (the token after its end-of-document
token; the document cut by a token hold-out ends the training split and starts the validation
split). Every file has an xxh3 checksum in the index. ``split_note`` says in one line how the
split was made (what ``moeflow prepare-data`` and ``moeflow train`` print).
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

from moeflow.checks import _float
from moeflow.train.data import ByteTokenizer, Tokenizer, tokenizer_from_dict
from moeflow.train.sources import DataError, Document, Documents

__all__ = ["DEFAULT_MIN_VAL_TOKENS", "DEFAULT_VAL_FRACTION", "FORMAT", "INDEX", "DataError", "file_xxh3",
           "min_split_tokens", "prepare", "split_note", "split_of", "token_dtype"]

FORMAT = "moeflow-tokens/1"
INDEX = "index.json"
_READ = 16 << 20  # checksum reads
_TASK_CHARS = 1 << 20  # text per tokenizing task
# the defaults of moeflow prepare-data and moeflow train alike, so that the two compose
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_MIN_VAL_TOKENS = 130  # min_split_tokens of moeflow train's default seq_len, 128


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
    """Appends tokens to one split's shard files, hashing as it writes; ``add`` appends a whole
    document (and records its end)."""

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

    def write(self, ids: np.ndarray) -> None:
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

    def add(self, ids: np.ndarray) -> None:
        self.write(ids)
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


class _SplitReader:
    """The tokens of one split's shard files, in order, ``take(n)`` at a time (16 MiB reads)."""

    def __init__(self, out: Path, shards: list[dict], dtype: np.dtype) -> None:
        self.shards, self.dtype = [(out / s["file"], s["tokens"]) for s in shards], dtype
        self._file = None
        self._left = 0  # tokens of the open shard not read yet

    def take(self, count: int) -> Iterator[np.ndarray]:
        while count > 0:
            if self._left == 0:
                path, self._left = self.shards.pop(0)
                self._file = open(path, "rb")  # noqa: SIM115 - closed once read to its end
            n = min(count, self._left, _READ // self.dtype.itemsize)
            chunk = np.fromfile(self._file, dtype=self.dtype, count=n)
            count, self._left = count - n, self._left - n
            if self._left == 0:
                self._file.close()
            yield chunk


def file_xxh3(path: Path) -> str:
    """The xxh3-128 hex digest of a file, read in 16 MiB pieces (no file is held in memory)."""
    h = _xxh3()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def min_split_tokens(seq_len: int) -> int:
    """The fewest tokens a split needs for ``TokenSampler`` to draw windows of ``seq_len`` (a
    sequence and its next tokens, with at least two starts to draw from)."""
    return seq_len + 2


def prepare(documents: Documents, tokenizer: Tokenizer, out_dir: str | os.PathLike, *,
            val_fraction: float = DEFAULT_VAL_FRACTION, min_val_tokens: int = DEFAULT_MIN_VAL_TOKENS, seed: int = 0,
            workers: int | None = None, shard_tokens: int = 1 << 28,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Tokenize ``documents`` into ``out_dir`` (module docstring: which validation split, and
    why); returns the index. ``min_val_tokens``: the fewest tokens a split of a hold-out keeps
    (``min_split_tokens(seq_len)`` of the training run). ``workers``: tokenizing processes
    (default: the CPUs, but one for the byte tokenizer, which turns text into tokens faster than
    a worker could hand them back; docs/benchmarks.md); ``progress(documents, tokens)`` after
    every chunk. ``out_dir`` must not exist or be empty; the index is written last, so a
    directory without one is an unfinished preparation (``TokenDataset`` refuses it). Too few
    tokens for a hold-out raise ``DataError`` naming the sources and the sizes."""
    _float("val_fraction", val_fraction)
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    for name, value in (("shard_tokens", shard_tokens), ("min_val_tokens", min_val_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty folder (prepare into a new one)")
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {name: _SplitWriter(out, name, dtype, shard_tokens) for name in ("train", "val")}
    if workers is None:
        workers = 1 if isinstance(tokenizer, ByteTokenizer) else os.cpu_count() or 1
    desc = tokenizer.to_dict()
    held = bytearray()  # per document in order: 1 where the hash held it out
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
                    _write(writers, encoded, splits, held, progress)
        else:
            for texts, splits, _ in tasks:
                _write(writers, [_encode_doc(tokenizer, t) for t in texts], splits, held, progress)
        for w in writers.values():
            w._close()
        tokens = {name: w.tokens for name, w in writers.items()}
        total = sum(tokens.values())
        if not held:
            raise DataError(f"no documents in {', '.join(documents.sources)}"
                            + (f" ({documents.skipped} empty ones skipped)" if documents.skipped else ""))
        if val_fraction == 0:
            how = "none"
        elif min(tokens.values()) >= min_val_tokens:
            how = "documents"
        else:  # too few documents to hold whole ones out: the last tokens instead
            how = "tokens"
            val_tokens = max(round(val_fraction * total), min_val_tokens)
            if total - val_tokens < min_val_tokens:
                raise DataError(
                    f"{', '.join(documents.sources)}: {total:,} tokens in {len(held):,} document(s) are too few for a "
                    f"validation split: holding out {val_tokens:,} (val_fraction={val_fraction} of them, at least "
                    f"min_val_tokens={min_val_tokens:,}, one window of seq_len + 2 tokens) leaves "
                    f"{total - val_tokens:,} for training, fewer than one window; give more text, or validation "
                    "data of its own (moeflow train --val-data)")
            writers = _split_by_tokens(out, writers, held, total - val_tokens)
        splits_index = {name: w.finish() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w._close()
        shutil.rmtree(out, ignore_errors=True)
        raise
    index = {"format": FORMAT, "tokenizer": desc, "dtype": dtype.name, "eod": tokenizer.eod,
             "sources": list(documents.sources), "files": list(documents.files), "documents": len(held),
             "val_fraction": val_fraction, "val_split": how, "min_val_tokens": min_val_tokens, "seed": seed,
             "skipped_empty": documents.skipped, "splits": {k: v for k, v in splits_index.items() if v is not None}}
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, out / INDEX)
    return index


def _write(writers: dict, encoded: list[np.ndarray], splits: list[str], held: bytearray,
           progress: Callable[[int, int], None] | None) -> None:
    for ids, split in zip(encoded, splits):  # (a tokenizer without an end token: the documents follow each other)
        writers[split].add(ids)
        held.append(split == "val")
    if progress is not None:
        progress(len(held), sum(w.tokens for w in writers.values()))


def _split_by_tokens(out: Path, by_docs: dict[str, _SplitWriter], held: bytearray, cut: int) -> dict[str, _SplitWriter]:
    """The corpus' tokens in document order (the hash's split undone), ``[0, cut)`` into a new
    training split and ``[cut, end)`` into a new validation split: two disjoint stretches, so no
    training window can hold a validation token. The document cut at ``cut`` ends the training
    split (without its end token) and begins the validation split. The files are rewritten
    (copied once) and replace the hash's."""
    held_N = np.frombuffer(bytes(held), dtype=np.uint8).astype(bool)
    length_N = np.empty(held_N.size, dtype=np.int64)
    for name, mask in (("train", ~held_N), ("val", held_N)):
        length_N[mask] = np.diff(np.asarray(by_docs[name].doc_ends, dtype=np.int64), prepend=0)
    ends_N = np.cumsum(length_N)
    tmp = out / ".by-tokens"
    tmp.mkdir()
    new = {name: _SplitWriter(tmp, name, w.dtype, w.shard_tokens) for name, w in by_docs.items()}
    readers = {name: _SplitReader(out, w.shards, w.dtype) for name, w in by_docs.items()}
    bounds = np.flatnonzero(np.diff(held_N.astype(np.int8))) + 1  # where a run of one split's documents ends
    pos = 0
    for a, b in zip([0, *bounds.tolist()], [*bounds.tolist(), held_N.size]):
        count = int(ends_N[b - 1] - (ends_N[a - 1] if a else 0))
        for chunk in readers["val" if held_N[a] else "train"].take(count):
            k = min(max(cut - pos, 0), chunk.size)  # the chunk's tokens before the cut
            new["train"].write(chunk[:k])
            new["val"].write(chunk[k:])
            pos += chunk.size
    new["train"].doc_ends = [*ends_N[ends_N < cut].tolist(), cut]
    new["val"].doc_ends = (ends_N[ends_N > cut] - cut).tolist()
    for w in new.values():
        w._close()
    for w in by_docs.values():
        for shard in w.shards:
            (out / shard["file"]).unlink()
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    for w in new.values():
        w.out = out
    return new


def split_note(index: dict) -> str:
    """One line: how the validation split of a prepared corpus (its ``index``) was made."""
    splits, fraction = index["splits"], index.get("val_fraction", 0)
    how = index.get("val_split", "documents" if "val" in splits else "none")  # older indexes: by documents
    if how == "none":
        return (f"validation: none (val_fraction {fraction}); moeflow train --data on it needs validation data of "
                "its own (--val-data)")
    total = sum(s["tokens"] for s in splits.values())
    val = splits["val"]
    docs = index.get("documents", sum(s["documents"] for s in splits.values()))
    if how == "documents":
        return (f"validation: held out {val['documents']:,} of {docs:,} documents ({val['tokens']:,} of {total:,} "
                f"tokens, {val['tokens'] / total:.1%}), chosen by a hash of their index (val_fraction {fraction})")
    return (f"validation: held out the last {val['tokens']:,} tokens of {total:,} ({val['tokens'] / total:.1%}), not "
            f"whole documents: {docs:,} document(s) are too few for val_fraction {fraction} of them to give each split "
            f"one window ({index['min_val_tokens']:,} tokens)")
