"""Token corpora on disk, memory-mapped a window at a time and sampled by step (legend: ``B``
sequences in a batch, ``S`` tokens per sequence). ``moeflow.train.prepare`` writes them (and
defines their format: ``index.json``, the checksummed token files); its ``prepare`` and
``split_of`` are part of this module's surface too.

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
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from moeflow.train.data import Tokenizer
from moeflow.train.prepare import FORMAT, INDEX, file_xxh3, min_split_tokens, prepare, split_of, token_dtype
from moeflow.train.sources import DataError

__all__ = ["FORMAT", "INDEX", "DataError", "prepare", "TokenDataset", "TokenSampler", "TokenStream", "Prefetcher",
           "split_of", "token_dtype"]


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
            if verify and file_xxh3(file) != shard["xxh3"]:
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
        if not parts:  # length 0 (np.concatenate takes no empty list)
            return np.zeros(0, dtype=np.int64)
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
            if ds.num_tokens < min_split_tokens(seq_len):
                raise DataError(f"{ds.path} ({ds.split}): {ds.num_tokens} tokens, fewer than one sequence of "
                                f"seq_len+1 = {seq_len + 1}")
        self.datasets, self.seq_len, self.seed = datasets, seq_len, seed
        self.weights = torch.tensor(weights, dtype=torch.float64, device="cpu")
        # the windows' possible starts per source: [0, span), a window being seq_len + 1 tokens (the
        # last start, num_tokens - seq_len - 1, reads the source's last token as its last target)
        self.span = [ds.num_tokens - seq_len for ds in datasets]
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
