"""One timed greedy generation of each of ``bench.generate``'s candidates (a call giving its
tokens per row, prefill and decode seconds: ``Run``), the turns they take, and the warm-up of
the compiled ones: moeflow's ``generate`` eager or compiled (``run_moeflow``), transformers'
``generate`` (``run_hf``; a streamer stamps the first new token) and its static-cache compiled
``generate`` with one ``StaticCache`` reused (``HFStaticGenerate``). On CUDA every clock
reading follows a device synchronisation."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench.common import sync

__all__ = ["Run", "CLOCKS", "FirstTokenClock", "synced", "run_moeflow", "run_hf", "take_turns", "warm_until_settled",
           "HFStaticGenerate"]

Run = Callable[[], tuple[list[list[int]], float, float]]  # -> (tokens per row, prefill_s, decode_s)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class FirstTokenClock:
    """A transformers streamer that stamps the time the first new tokens arrive (its second
    ``put``: the first one is the prompt)."""

    def __init__(self, clock) -> None:  # type: ignore[no-untyped-def]
        self.clock = clock
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = self.clock()

    def end(self) -> None:
        pass


def synced(clock, device: torch.device):  # type: ignore[no-untyped-def]
    """``clock`` read after the device finished its work (CUDA); ``clock`` itself on the CPU."""
    if device.type != "cuda":
        return clock

    def read() -> float:
        sync(device)
        return clock()
    return read


def run_moeflow(model, idx_BS: torch.Tensor, n: int, clock, compile: bool = False  # type: ignore[no-untyped-def]
                ) -> tuple[list[list[int]], float, float]:
    """moeflow's ``generate``, greedy, ``n`` new tokens, eager or ``compile=True``."""
    from moeflow.models.generation import generate

    out = generate(model, idx_BS, n, temperature=0, clock=synced(clock, idx_BS.device), compile=compile)
    return out.tokens, out.prefill_s, out.decode_s


def run_hf(hf, idx_BS: torch.Tensor, n: int, clock, **generate_kw  # type: ignore[no-untyped-def]
           ) -> tuple[list[list[int]], float, float]:
    """transformers' ``generate``, greedy, exactly ``n`` new tokens; ``generate_kw``: more of its
    keywords (``HFStaticGenerate`` hands it a ``StaticCache`` and a ``CompileConfig``)."""
    clock = synced(clock, idx_BS.device)
    stamp = FirstTokenClock(clock)
    with torch.no_grad():
        t0 = clock()
        out = hf.generate(idx_BS, attention_mask=torch.ones_like(idx_BS), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, num_beams=1, pad_token_id=0, streamer=stamp, **generate_kw)
        t2 = clock()
    t1 = stamp.first if stamp.first is not None else t2
    return out[:, idx_BS.shape[1]:].tolist(), t1 - t0, t2 - t1


def take_turns(cands: dict[str, Run], repeats: int
               ) -> tuple[dict[str, tuple[float, float]], dict[str, list[list[int]]]]:
    """Each candidate (a call giving its tokens, prefill and decode seconds) once a round for
    ``repeats`` rounds, in turn, the order reversed every other round (fair under a fluctuating
    load): each one's median (prefill_s, decode_s), in ``cands``' order, and its last tokens."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cands}
    tokens: dict[str, list[list[int]]] = {}
    names = list(cands)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            toks, pre, dec = cands[name]()
            times[name].append((pre, dec))
            tokens[name] = toks
    medians = {name: (statistics.median(t[0] for t in times[name]), statistics.median(t[1] for t in times[name]))
               for name in names}
    return medians, tokens


def warm_until_settled(run: Run, *, tol: float = 0.05, min_calls: int = 3, max_calls: int = 8) -> dict:
    """Call ``run`` (a generation: tokens, prefill and decode seconds) until the decode times of
    its last two calls are within ``tol`` of each other, after at least ``min_calls`` calls (the
    first compiles, the second may still record CUDA graphs) and at most ``max_calls``: the
    compiled candidates' warm-up, so that the timed calls replay what is built.
    ``{"calls", "settled", "decode_s": [per call]}``."""
    if not 2 <= min_calls <= max_calls:
        raise ValueError(f"need 2 <= min_calls <= max_calls, got min_calls={min_calls}, max_calls={max_calls}")
    if not 0 < tol < 1:
        raise ValueError(f"tol must be in (0, 1), got {tol}")
    times: list[float] = []
    settled = False
    while len(times) < max_calls:
        times.append(run()[2])
        a, b = times[-2:] if len(times) > 1 else (times[0], float("inf"))
        settled = abs(a - b) <= tol * min(a, b)
        if settled and len(times) >= min_calls:
            break
    return {"calls": len(times), "settled": settled, "decode_s": times}


class HFStaticGenerate:
    """transformers' compiled static-cache decoding, run so that its graphs are replayed: one
    ``StaticCache`` per (rows, length), made on the first call and ``reset()`` before each
    later one, handed to ``generate(past_key_values=...)``; the forward compiled by transformers
    (``get_compiled_call``) with ``CompileConfig(fullgraph=True, dynamic=False)``, CUDA graphs
    (``mode="reduce-overhead"``) on CUDA, plain inductor on the CPU (``_compile_all_devices``:
    transformers compiles on CUDA only by itself). Its own ``cache_implementation="static"``
    builds a new cache at every call: new addresses for what the step writes, which CUDA graphs
    record again at every call. ``caches_made`` counts the caches built."""

    def __init__(self, hf: torch.nn.Module) -> None:
        from transformers import CompileConfig

        self.hf = hf
        cuda = hf.device.type == "cuda"
        self.compile_config = CompileConfig(fullgraph=True, dynamic=False,
                                            mode="reduce-overhead" if cuda else "default")
        self.compile_config._compile_all_devices = True
        self.caches: dict[tuple[int, int], object] = {}
        self.caches_made = 0

    def cache(self, rows: int, length: int):  # type: ignore[no-untyped-def]
        """The ``StaticCache`` of ``rows`` rows and ``length`` columns, emptied."""
        from transformers import StaticCache

        cache = self.caches.get((rows, length))
        if cache is None:
            cache = self.caches[(rows, length)] = StaticCache(config=self.hf.config, max_cache_len=length)
            self.caches_made += 1
        cache.reset()
        return cache

    def __call__(self, idx_BS: torch.Tensor, n: int, clock: Callable[[], float]
                 ) -> tuple[list[list[int]], float, float]:
        cache = self.cache(idx_BS.shape[0], idx_BS.shape[1] + n)
        return run_hf(self.hf, idx_BS, n, clock, past_key_values=cache, compile_config=self.compile_config)
