"""Token corpora on disk: prepared once, memory-mapped a window at a time, sampled by step
(legend: ``B`` sequences in a batch, ``S`` tokens per sequence).

``prepare(sources, tokenizer, out_dir)`` (``moeflow prepare-data``) tokenizes the documents of
``moeflow.train.sources`` in parallel worker processes, in document order, each document followed
by the tokenizer's end-of-document token (if it has one), into flat token files (``uint16`` when the vocabulary
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

``TokenDataset(path, split)`` opens a split: the checksums are verified (in 16 MiB reads: no file
is held in memory), the tokenizer can be required to match, and ``read(start, length)`` copies
tokens out of a **window** of at most ``window_bytes`` of one shard, memory-mapped on demand and
unmapped when a read falls outside it; so however large the corpus, a process holds one window
per shard at most, and its resident memory stays flat. ``in_memory`` builds one from a token
array (small corpora tokenized at the start of a run).

``TokenSampler(datasets, weights, seq_len, seed)`` draws every step's global batch from a
generator seeded with ``(seed, step)``: the source of each sequence (by ``weights``), then its
start, uniform over the source. Rank ``r`` of ``W`` reads only its ``B/W`` rows. ``TokenStream``
is the sampler of one token sequence in memory (the built-in corpus). So a batch
depends on the step alone: a run resumed or restarted at step ``s``, on any number of ranks,
sees exactly the batches an uninterrupted run would (the data's position is the step, which the
checkpoint holds, and the data's ``fingerprint``, which the checkpoint records). ``Prefetcher``
reads the next batch in a background thread while the current step runs.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import mmap
import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from moeflow.train.data import ByteTokenizer, Tokenizer, tokenizer_from_dict
from moeflow.train.sources import DataError, Document, Documents

__all__ = ["FORMAT", "DataError", "prepare", "TokenDataset", "TokenSampler", "TokenStream", "Prefetcher", "split_of",
           "token_dtype"]

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
                "doc_ends_xxh3": _file_xxh3(self.out / docs_file), "shards": self.shards}


def _file_xxh3(path: Path) -> str:
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


# ----------------------------------------------------------------------------------- reading


class _Window:
    """One shard file, memory-mapped a window of at most ``window_bytes`` at a time."""

    def __init__(self, path: Path, dtype: np.dtype, tokens: int, window_bytes: int) -> None:
        self.path, self.dtype, self.tokens = path, dtype, tokens
        self.window = max(window_bytes, mmap.ALLOCATIONGRANULARITY)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._start = self._end = 0  # byte range of the mapped window
        self._lock = threading.Lock()

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of this shard, as a new int64 array."""
        item = self.dtype.itemsize
        lo, hi = start * item, (start + length) * item
        with self._lock:
            if self._map is None or lo < self._start or hi > self._end:
                self._remap(lo, hi)
            view = np.frombuffer(self._map, dtype=self.dtype, count=length, offset=lo - self._start)
            out = view.astype(np.int64)
            del view
            return out

    def _remap(self, lo: int, hi: int) -> None:
        self.close()
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = self.tokens * self.dtype.itemsize
        start = lo - lo % mmap.ALLOCATIONGRANULARITY
        end = min(size, max(hi, start + self.window))
        self._map = mmap.mmap(self._fd, end - start, access=mmap.ACCESS_READ, offset=start)
        self._start, self._end = start, end

    def close(self) -> None:
        if self._map is not None:
            self._map.close()  # unmapped: its pages leave this process's resident memory
            self._map = None

    def __del__(self) -> None:
        self.close()
        if self._fd is not None:
            os.close(self._fd)


class TokenDataset:
    """A split of a prepared corpus (module docstring), or tokens in memory (``in_memory``)."""

    def __init__(self, path: str | os.PathLike, split: str = "train", *, window_bytes: int = 256 << 20,
                 verify: bool = True, tokenizer: dict | None = None) -> None:
        self.path = Path(path)
        index_file = self.path / INDEX
        if not index_file.is_file():
            raise DataError(f"{self.path}: no {INDEX} (not a prepared corpus, or its preparation did not finish)")
        try:
            index = json.loads(index_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{index_file}: not JSON ({err})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise DataError(f"{index_file}: not a {FORMAT} index")
        if split not in index.get("splits", {}):
            raise DataError(f"{self.path}: no {split!r} split (it has {sorted(index.get('splits', {}))}; prepare with "
                            "--val-fraction, or give --val-data)")
        if tokenizer is not None and tokenizer != index["tokenizer"]:
            raise DataError(f"{self.path}: the shards were tokenized with {_tok_name(index['tokenizer'])}, not "
                            f"{_tok_name(tokenizer)}: prepare the corpus again with this tokenizer")
        self.index, self.split = index, split
        self.tokenizer = index["tokenizer"]
        self.eod = index.get("eod")
        meta = index["splits"][split]
        dtype = np.dtype(index["dtype"])
        self.num_tokens = int(meta["tokens"])
        self.num_documents = int(meta["documents"])
        self._windows: list[_Window] = []
        self._starts: list[int] = []
        at = 0
        for shard in meta["shards"]:
            file = self.path / shard["file"]
            if not file.is_file():
                raise DataError(f"{file}: missing (listed in {index_file})")
            if file.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise DataError(f"{file}: {file.stat().st_size} bytes, the index says {shard['tokens']} tokens of "
                                f"{dtype.itemsize} bytes (truncated or replaced)")
            if verify and _file_xxh3(file) != shard["xxh3"]:
                raise DataError(f"{file}: checksum mismatch (the file changed since it was prepared)")
            self._windows.append(_Window(file, dtype, shard["tokens"], window_bytes))
            self._starts.append(at)
            at += shard["tokens"]
        self._memory: np.ndarray | None = None
        self.fingerprint = hashlib.sha256(json.dumps({"split": split, **meta}, sort_keys=True).encode()).hexdigest()

    @classmethod
    def in_memory(cls, tokens: np.ndarray, tokenizer: dict, *, eod: int | None, name: str) -> "TokenDataset":
        """A dataset over ``tokens`` (int array) held in this process (a small corpus)."""
        self = cls.__new__(cls)
        self.path, self.split, self.index = Path(name), "memory", {}
        self.tokenizer, self.eod = tokenizer, eod
        self._memory = np.asarray(tokens, dtype=np.int64)
        self.num_tokens = int(self._memory.size)
        self.num_documents = int((self._memory == eod).sum()) if eod is not None else 1
        self._windows, self._starts = [], []
        self.fingerprint = hashlib.sha256(self._memory.tobytes()).hexdigest()
        return self

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` (int64, a copy; across shard ends too)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside {self.path} ({self.num_tokens} tokens)")
        if self._memory is not None:
            return self._memory[start : start + length].copy()
        parts, pos, end = [], start, start + length
        i = bisect.bisect_right(self._starts, pos) - 1
        while pos < end:
            window = self._windows[i]
            local = pos - self._starts[i]
            take = min(end - pos, window.tokens - local)
            parts.append(window.read(local, take))
            pos += take
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def close(self) -> None:
        for w in self._windows:
            w.close()


def _tok_name(desc: dict) -> str:
    kind = desc.get("kind", "?") if isinstance(desc, dict) else "?"
    return f"a {kind} tokenizer" + (f" ({hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:8]})"
                                    if isinstance(desc, dict) and "json" in desc else "")


class TokenSampler:
    """Random windows of one or more token datasets, drawn by step (module docstring)."""

    def __init__(self, datasets: list[TokenDataset], weights: list[float] | None, seq_len: int, seed: int) -> None:
        if not datasets:
            raise ValueError("datasets is empty")
        weights = [1.0] * len(datasets) if weights is None else [float(w) for w in weights]
        if len(weights) != len(datasets) or any(not w > 0 for w in weights):
            raise ValueError(f"weights must be one positive number per dataset, got {weights}")
        for ds in datasets:
            if ds.num_tokens <= seq_len + 1:
                raise DataError(f"{ds.path} ({ds.split}): {ds.num_tokens} tokens, fewer than one sequence of "
                                f"seq_len+1 = {seq_len + 1}")
        self.datasets, self.seq_len, self.seed = datasets, seq_len, seed
        self.weights = torch.tensor(weights, dtype=torch.float64, device="cpu")
        # the windows' possible starts per source: [0, span)
        self.span = [ds.num_tokens - seq_len - 1 for ds in datasets]
        self.fingerprint = hashlib.sha256(json.dumps([[ds.fingerprint for ds in datasets], weights]).encode()).hexdigest()

    def starts(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(source [B], start [B])`` of step ``step``'s global batch."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        if len(self.datasets) == 1:
            source = torch.zeros(batch_size, dtype=torch.long, device="cpu")
            return source, torch.randint(0, self.span[0], (batch_size,), generator=gen, device="cpu")
        source = torch.multinomial(self.weights, batch_size, replacement=True, generator=gen)
        u = torch.rand(batch_size, generator=gen, dtype=torch.float64, device="cpu")
        span = torch.tensor(self.span, dtype=torch.float64, device="cpu")
        return source, (u * span[source]).floor().long()

    def batch(self, step: int, batch_size: int, *, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs [B/world, S], targets [B/world, S])``: this rank's rows of step ``step``'s
        global batch of ``batch_size`` windows; only those rows are read."""
        if batch_size % world:
            raise ValueError(f"batch_size={batch_size} must be divisible by the number of ranks {world}")
        source, start = self.starts(step, batch_size)
        per = batch_size // world
        rows = [self.datasets[int(s)].read(int(t), self.seq_len + 1)
                for s, t in zip(source[rank * per : (rank + 1) * per], start[rank * per : (rank + 1) * per])]
        tokens = torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, self.seq_len + 1, dtype=torch.long, device="cpu")
        return tokens[:, :-1], tokens[:, 1:]


class TokenStream(TokenSampler):
    """Random windows of one token sequence held in memory (the built-in corpus): the sampler
    over ``TokenDataset.in_memory``, so it draws the batches of every step as one's own data does."""

    def __init__(self, ids_N: torch.Tensor, seq_len: int, seed: int) -> None:
        if ids_N.dim() != 1 or ids_N.numel() <= seq_len + 1:
            raise ValueError(f"need more than seq_len+1={seq_len + 1} tokens, got {ids_N.numel()}")
        dataset = TokenDataset.in_memory(ids_N.numpy(), {}, eod=None, name="tokens in memory")
        super().__init__([dataset], None, seq_len, seed)

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer, seq_len: int, seed: int) -> "TokenStream":
        # the corpus stays in host memory; the training loop moves each batch to its device
        return cls(torch.tensor(tokenizer.encode(text), dtype=torch.int64, device="cpu"), seq_len, seed)


class Prefetcher:
    """``batch(...)`` of a sampler, with the next one read ahead in a background thread: the
    training loop asks for the batches of consecutive indices, so after the first one each is
    ready (or nearly) when asked for. Results are exactly the sampler's."""

    def __init__(self, sampler: TokenSampler) -> None:
        self.sampler = sampler
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-data")
        self._ahead: tuple[tuple, Future] | None = None
        self.waited_s = 0.0  # time the caller spent waiting for a batch (the loader's share of a step)

    def batch(self, step: int, batch_size: int, *, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        key = (step, batch_size, rank, world)
        t0 = time.perf_counter()
        if self._ahead is not None and self._ahead[0] == key:
            out = self._ahead[1].result()
        else:
            out = self.sampler.batch(step, batch_size, rank=rank, world=world)
        self.waited_s += time.perf_counter() - t0
        nxt = (step + 1, batch_size, rank, world)
        self._ahead = (nxt, self._pool.submit(self.sampler.batch, step + 1, batch_size, rank=rank, world=world))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
