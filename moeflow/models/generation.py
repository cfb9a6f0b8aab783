"""Text generation with ``MoEGPT``: a batch of prompts of any lengths, KV-cached decoding,
greedy or sampled (temperature, top-k, top-p), per-row stop tokens (legend below).

The prompts are left-padded to one length and run once (prefill, ``MoEGPT.forward_cached``
into a ``KVCache``); then each step feeds one token per unfinished row. A row that produced a
stop token leaves the batch (its cache rows are dropped), so the remaining rows do not pay for
it. The context of each token is the last ``max_seq_len`` tokens of its row, as the model's
docs state: once a row is longer, the window slides and every further token re-runs the window
(the keys of a cropped context differ from the cached ones in every block past the first, so
they cannot be reused); give the model a ``max_seq_len`` of at least prompt + new tokens to
stay on the cached path. ``generate_uncached`` is the plain loop (the whole context per token),
the reference the tests hold the cached path to.

Randomness: a sampled token is drawn with the caller's ``generator`` on *the generator's* device
(``sample_next``). A generator on the logits' device (``torch.Generator(device=...)``) draws in
place; any other one still works: each step's probabilities ``[B, V]`` are copied to it and the
tokens back (a CPU generator with a model on CUDA draws as it would on the CPU, at one copy a
step). ``moeflow generate`` makes its generator on the model's device.

Every step goes through each block's own layers (the MoE's router, dispatcher and experts), so
a model whose experts live elsewhere (``moeflow.storage``) generates through the same code.

Compiled decode (``generate(..., compile=True)``, ``moeflow generate --compile``): every step is
``MoEGPT.decode_step``, whose shapes depend only on the batch size and the cache capacity, so
``torch.compile(fullgraph=True)`` compiles it once (on CUDA with CUDA graphs: ``mode=
"reduce-overhead"``) and later steps and calls replay it (``CompiledDecoder``). To make that
hold, a compiled generation differs from the eager loop in three ways, none visible in its
tokens: the cache capacity is rounded up to a power of two (at least 16, at most
``max_seq_len``), so calls of different lengths share a compilation; finished rows stay in the
batch (their extra tokens are cut afterwards) instead of leaving it; and stop tokens are
checked on the device, the host reading whether every row has stopped once every
``STOP_CHECK_EVERY`` steps (the eager loop reads every step's tokens). A step has no host
synchronisation (``tests/test_models_generation_compiled.py`` checks it); sampling runs eagerly
between steps. On the CPU the head's product runs after the compiled graph, in the layout
measured fastest for the batch size on this machine (``HeadProduct``: the logits equal up to
rounding). Past ``max_seq_len`` the window slides as in the eager loop (those steps run
eagerly: each re-runs the window).

Legend: ``B`` rows still generating, ``S`` columns, ``V`` vocabulary.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeflow.checks import _int

__all__ = ["SamplingConfig", "Generation", "generate", "generate_uncached", "generate_tensor", "sample_next",
           "draw_device", "CompiledDecoder", "compiled_decoder", "STOP_CHECK_EVERY", "HeadProduct", "head_product",
           "HEAD_LAYOUTS"]

STOP_CHECK_EVERY = 8  # compiled decode: steps between the host's looks at whether every row stopped


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen from the logits; validated on construction.

    ``temperature=0`` is greedy (argmax); else the logits are divided by ``temperature``, cut
    to the ``top_k`` largest (0: no cut) and then to the smallest set of tokens whose
    probability adds up to at least ``top_p`` (1: no cut), and one token is drawn. ``eos``:
    the stop tokens (a token id, a collection of them, or None), a ``frozenset`` once built;
    a row stops after producing one. ``check_vocab`` checks them against a vocabulary."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(t).__name__} {t!r}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t}")
        _int("top_k", self.top_k, minimum=0)
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise TypeError(f"top_p must be a number, got {type(p).__name__} {p!r}")
        if not (0 < p <= 1):  # also refuses nan
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        eos: object = self.eos
        if eos is None:
            eos = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos = (eos,)
        elif not isinstance(eos, (list, tuple, set, frozenset)):
            raise TypeError(f"eos must be a token id, a list of token ids or None, got {type(eos).__name__} {eos!r}")
        object.__setattr__(self, "eos", frozenset(_check_token_ids("eos", eos)))

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` (naming ``eos`` and the id) if a stop token is not below ``vocab_size``."""
        _check_token_ids("eos", sorted(self.eos), vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Generation:
    """New tokens per prompt (a stop token ends its row and is included) and the time spent.

    ``prefill_s`` runs the prompts and picks each row's first token; ``decode_s`` the rest
    (``decode_tokens`` of them)."""

    tokens: list[list[int]]
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def draw_device(generator: torch.Generator | None, logits_device: torch.device) -> torch.device:
    """Where ``sample_next`` draws: on ``generator``'s device (torch draws only there), on the
    logits' device without one (torch's default generator of that device)."""
    return logits_device if generator is None else torch.device(generator.device)


def sample_next(logits_BV: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token ``[B]`` (int64, on ``logits_BV``'s device) of each row of ``logits_BV``
    (computed in >= fp32). ``generator`` may live on another device than the logits: the draw
    runs on the generator's (``draw_device``; the probabilities are copied there and the tokens
    back): a CPU generator draws from the same probabilities as it would with the model on the
    CPU."""
    if sampling.greedy:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV.to(torch.promote_types(logits_BV.dtype, torch.float32)) / sampling.temperature
    V = logits_BV.shape[-1]
    if 0 < sampling.top_k < V:
        kth_B1 = torch.topk(logits_BV, sampling.top_k).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if sampling.top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        # drop a token when the more likely ones already hold top_p of the mass (never the first)
        drop_BV = (probs_BV.cumsum(-1) - probs_BV) >= sampling.top_p
        drop_BV[:, 0] = False
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(-1)
    where = draw_device(generator, probs_BV.device)
    if where == probs_BV.device:
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
    return torch.multinomial(probs_BV.to(where), 1, generator=generator).squeeze(1).to(logits_BV.device)


def _check_token_ids(name: str, ids: Iterable[object], vocab_size: int | None = None) -> list[int]:
    """``ids`` as a list, each an int (not a bool) in ``[0, vocab_size)`` (``>= 0`` without a
    vocabulary); errors name ``name`` and the value."""
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"{name} holds {type(t).__name__} {t!r}; token ids are ints")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size or 'vocab_size'}), got {t}")
        out.append(t)
    return out


def _check_prompts(prompts: object, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype not in (torch.int64, torch.int32) or prompts.dim() != 2 or 0 in prompts.shape:
            raise ValueError(f"prompts must be an int tensor [batch, seq] with at least one token per row, got "
                             f"{prompts.dtype} {tuple(prompts.shape)}")
        lo, hi = int(prompts.min()), int(prompts.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompts: token ids must be in [0, {vocab_size}), got {lo if lo < 0 else hi}")
        return prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise TypeError(f"prompts must be a non-empty list of token-id lists or an int tensor [batch, seq], "
                        f"got {type(prompts).__name__} {prompts!r:.80}")
    rows = []
    for i, row in enumerate(prompts):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {row!r:.80}")
        rows.append(_check_token_ids(f"prompts[{i}]", row, vocab_size))
    return rows


def _check_args(model, max_new_tokens: object, generator: object, **sampling: object) -> SamplingConfig:
    """The checked ``SamplingConfig`` of a call (``sampling``: its fields; ``top_k=None`` is 0),
    after checking the call's other arguments; errors name the argument and value."""
    from moeflow.models.gpt import MoEGPT

    if not isinstance(model, MoEGPT):
        raise TypeError(f"model must be a MoEGPT, got {type(model).__name__}")
    _int("max_new_tokens", max_new_tokens, minimum=0)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    config = SamplingConfig(**{**sampling, "top_k": sampling.get("top_k") or 0})  # type: ignore[arg-type]
    config.check_vocab(model.config.vocab_size)
    return config


def _prefill(model, seq_BS: torch.Tensor, pad_B: torch.Tensor, capacity: int):
    """A new cache holding the last ``max_seq_len`` columns of ``seq_BS``, and the logits of the
    last column ``[B, V]``."""
    start = max(0, seq_BS.shape[1] - model.config.max_seq_len)
    cache = model.new_cache((pad_B - start).clamp(min=0), capacity)
    return cache, model.forward_cached(seq_BS[:, start:], cache)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
             eos: int | Sequence[int] | None = None, generator: torch.Generator | None = None,
             clock: Callable[[], float] = time.perf_counter, compile: bool = False) -> Generation:
    """Up to ``max_new_tokens`` new tokens for each prompt (lists of token ids of any lengths,
    or an int tensor ``[B, S]``), KV-cached; sampling as in ``SamplingConfig``; a row stops
    after a token of ``eos``. ``generator`` (None: torch's default) may be on any device: the
    draws run on its device (``sample_next``). Bad arguments raise ``ValueError``/``TypeError``
    naming them.
    ``clock`` times prefill and decode (wall time; ``time.process_time`` gives CPU time, steadier
    on a shared machine; a compiled generation synchronises a CUDA device before each reading).
    ``compile=True``: the decode steps run the compiled static step (module docstring; the
    first call of a batch size and cache capacity compiles and warms it up before the clock
    starts)."""
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {type(compile).__name__} {compile!r}")
    sampling = _check_args(model, max_new_tokens, generator, temperature=temperature, top_k=top_k, top_p=top_p, eos=eos)
    if compile:
        return _generate_compiled(model, prompts, max_new_tokens, sampling, generator, clock)
    V, device = model.config.vocab_size, model.embed.weight.device
    rows = _check_prompts(prompts, V)
    stop = sampling.eos
    out: list[list[int]] = [[] for _ in rows]
    prompt_tokens = sum(len(r) for r in rows)
    if max_new_tokens == 0:
        return Generation(tokens=out, prefill_tokens=prompt_tokens, prefill_s=0.0, decode_tokens=0, decode_s=0.0)
    P = max(len(r) for r in rows)
    # the token history, left-padded (pad id 0, never attended to): the sliding window reads it
    seq_BS = torch.zeros(len(rows), P + max_new_tokens, dtype=torch.long, device=device)
    seq_BS[:, :P] = torch.tensor([[0] * (P - len(r)) + r for r in rows], dtype=torch.long, device=device)
    pad_B = torch.tensor([P - len(r) for r in rows], dtype=torch.long, device=device)
    # columns ever fed: the prompt and every new token but the last
    capacity = min(model.config.max_seq_len, P + max_new_tokens - 1)
    live = list(range(len(rows)))  # the prompt of each cache row
    cols = P

    t0 = clock()
    cache, logits_BV = _prefill(model, seq_BS[:, :cols], pad_B, capacity)
    t1 = None
    for step in range(max_new_tokens):
        next_B = sample_next(logits_BV, sampling, generator)
        ids = next_B.tolist()  # the one host sync of a step (stop tokens are checked here)
        if t1 is None:
            t1 = clock()
        seq_BS[:, cols] = next_B
        cols += 1
        keep = []
        for i, (r, t) in enumerate(zip(live, ids)):
            out[r].append(t)
            if t not in stop:
                keep.append(i)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(live):
            keep_B = torch.tensor(keep, dtype=torch.long, device=device)
            seq_BS, next_B, pad_B = seq_BS.index_select(0, keep_B), next_B.index_select(0, keep_B), pad_B[keep_B]
            cache.keep_rows(keep_B)
            live = [live[i] for i in keep]
        if cache.length < cache.capacity:
            logits_BV = model.forward_cached(next_B.unsqueeze(1), cache)
        else:  # the context is longer than max_seq_len: the window slides
            cache, logits_BV = _prefill(model, seq_BS[:, :cols], pad_B, capacity)
    t2 = clock()
    generated = sum(len(o) for o in out)
    return Generation(tokens=out, prefill_tokens=prompt_tokens, prefill_s=t1 - t0,  # type: ignore[operator]
                      decode_tokens=generated - len(rows), decode_s=t2 - t1)  # type: ignore[operator]


def _bucket(columns: int, max_seq_len: int) -> int:
    """The cache capacity of a compiled generation needing ``columns``: the next power of two
    (at least 16), at most ``max_seq_len``; calls of similar lengths share one compilation."""
    return min(max_seq_len, max(16, 1 << max(0, columns - 1).bit_length()))


HEAD_LAYOUTS = ("linear", "dv", "vd")  # HeadProduct's ways of multiplying the head


def head_product(layout: str, h_BD: torch.Tensor, weight_VD: torch.Tensor,
                 weight_DV: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[B, V] = h [B, D] W^T`` of a bias-free head ``W [V, D]`` in one of
    ``HEAD_LAYOUTS``: ``"linear"`` ``F.linear(h, W)`` (what ``nn.Linear`` runs), ``"dv"``
    ``h @ W_DV`` (``weight_DV``: a contiguous ``[D, V]`` copy of ``W``), ``"vd"`` ``(W h^T)^T``
    (a transposed view). The same sums in another order: equal up to rounding."""
    if layout == "linear":
        return F.linear(h_BD, weight_VD)
    if layout == "dv":
        if weight_DV is None:
            raise ValueError("head_product('dv', ...) needs weight_DV, the [D, V] copy of the head's weight")
        return h_BD @ weight_DV
    if layout == "vd":
        return (weight_VD @ h_BD.t()).t()
    raise ValueError(f"layout must be one of {HEAD_LAYOUTS}, got {layout!r}")


class HeadProduct:
    """The output projection of the CPU's compiled decode step, in whichever of
    ``HEAD_LAYOUTS`` is fastest for ``B`` rows on this machine (``head_product``).

    A decode step's head product has a few rows and a weight ``[V, D]`` that comes from memory,
    and the BLAS runs it at very different speeds by layout, rows and CPU: measured on this
    project's VMs (``docs/benchmarks.md``), ``"dv"`` took ~2/3 of ``"linear"``'s time at 8 rows
    on an Intel Xeon, and on an AMD EPYC ~1/2 at 1 row but ~6/5 at 8 rows, where ``"vd"`` was
    fastest. So the layout of each row count is measured once, on the model's own weight
    (``tune``: each layout timed ``repeats`` times, the cache flushed before each, the median
    taken; ``timer`` is the clock). ``begin`` starts a generation: it takes the weight and,
    when the layout needs one, a fresh ``[D, V]`` copy, so the product follows the weight
    through training between calls; the copy costs the head's memory once more while that
    generation runs."""

    FLUSH_BYTES = 64 << 20  # read before each timing: the weight comes from memory, as in a step

    def __init__(self, *, repeats: int = 5, timer: Callable[[], float] = time.perf_counter) -> None:
        _int("repeats", repeats, minimum=1)
        self.repeats, self.timer = repeats, timer
        self.choice: dict[int, str] = {}  # rows -> layout
        self.weight_VD: torch.Tensor | None = None
        self.weight_DV: torch.Tensor | None = None

    def begin(self, weight_VD: torch.Tensor, rows: int) -> None:
        """Before a generation of ``rows`` rows with head weight ``weight_VD``: tune ``rows``
        if it is new, then keep the weight (and its ``[D, V]`` copy where the layout needs it)."""
        self.weight_VD = weight_VD.detach()
        if rows not in self.choice:
            self.choice[rows] = self.tune(rows)
        self.weight_DV = self.weight_VD.t().contiguous() if self.choice[rows] == "dv" else None

    def tune(self, rows: int) -> str:
        """The fastest layout for ``rows`` rows with the weight of ``begin``."""
        assert self.weight_VD is not None
        w = self.weight_VD
        gen = torch.Generator(device=w.device).manual_seed(0)  # the caller's random stream is left alone
        h_BD = torch.randn(rows, w.shape[1], generator=gen, device=w.device, dtype=w.dtype)
        w_DV = w.t().contiguous()
        flush = torch.ones(self.FLUSH_BYTES // 4, dtype=torch.float32, device=w.device)
        times: dict[str, list[float]] = {layout: [] for layout in HEAD_LAYOUTS}
        for _ in range(self.repeats):
            for layout in HEAD_LAYOUTS:
                flush.sum()
                t0 = self.timer()
                head_product(layout, h_BD, w, w_DV)
                times[layout].append(self.timer() - t0)
        return min(HEAD_LAYOUTS, key=lambda layout: sorted(times[layout])[self.repeats // 2])

    def __call__(self, h_BD: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of the normed hidden states ``h [B, D]`` (after ``begin``)."""
        assert self.weight_VD is not None, "HeadProduct.begin comes first"
        return head_product(self.choice[h_BD.shape[0]], h_BD, self.weight_VD, self.weight_DV)


def _tunes_head(model) -> bool:  # type: ignore[no-untyped-def]
    """Whether the compiled step leaves the head to a ``HeadProduct`` (a plain bias-free
    ``nn.Linear`` head on the CPU; on CUDA the head stays inside the graph CUDA graphs replay)."""
    head = model.lm_head
    return model.embed.weight.device.type == "cpu" and type(head) is torch.nn.Linear and head.bias is None


class CompiledDecoder:
    """One model's compiled static decode step (``MoEGPT.decode_step`` through
    ``torch.compile(fullgraph=True)``, with CUDA graphs on CUDA) and the caches it runs on.

    A cache per batch size and capacity is kept and reused by later calls (zeroed each time):
    CUDA graphs replay on fixed addresses, and the cache is what the step writes. At most
    ``max_caches`` are kept (the least recently used go). ``compilations`` counts the shapes
    prepared so far (each compiled and warmed up on first use, before any timing).

    On the CPU, with a plain ``nn.Linear`` head, the compiled graph is ``MoEGPT.decode_hidden``
    and the head's product runs after it through ``head`` (a ``HeadProduct``: the layout fastest
    for the rows on this machine); elsewhere the graph is the whole ``decode_step``."""

    def __init__(self, model, *, max_caches: int = 4) -> None:  # type: ignore[no-untyped-def]
        self.device = model.embed.weight.device
        self.cuda = self.device.type == "cuda"
        self.head = HeadProduct() if _tunes_head(model) else None
        self.step = torch.compile(model.decode_step if self.head is None else model.decode_hidden,
                                  fullgraph=True, dynamic=False, mode="reduce-overhead" if self.cuda else None)
        self.caches: dict[tuple[int, int], object] = {}
        self.max_caches = max_caches
        self.compilations = 0

    def cache(self, model, pad_B: torch.Tensor, capacity: int):  # type: ignore[no-untyped-def]
        """A zeroed cache of ``capacity`` columns for these rows (``pad_B``), with the step
        compiled and warmed up for its shape."""
        key = (pad_B.shape[0], capacity)
        cache = self.caches.pop(key, None)
        if cache is None:
            cache = model.new_cache(pad_B, capacity, zeroed=True)
            if self.cuda:  # the step writes into the cache: CUDA graphs need it at fixed addresses
                for t in (*cache.k, *cache.v):
                    torch._dynamo.mark_static_address(t)
            try:
                self._warm_up(cache, pad_B)
            except torch._dynamo.exc.TorchDynamoException as err:  # e.g. a host read in a custom layer
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ValueError(f"compile=True: this model's decode step does not compile as one graph ({first}); "
                                 "generate without compile") from err
            self.compilations += 1
            while len(self.caches) >= self.max_caches:
                self.caches.pop(next(iter(self.caches)))
        else:
            cache.reset(pad_B)
        self.caches[key] = cache  # the most recently used last
        return cache

    def _warm_up(self, cache, pad_B: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        tokens_B = torch.zeros(cache.batch, dtype=torch.long, device=self.device)
        pos = torch.zeros((), dtype=torch.long, device=self.device)
        for _ in range(3 if self.cuda else 1):  # CUDA graphs record on the second or third call
            self.mark_step()
            self.step(tokens_B, pos, cache)
        cache.reset(pad_B)

    def begin(self, model, rows: int) -> None:  # type: ignore[no-untyped-def]
        """Before a generation of ``rows`` rows: the head's weight as it is now (``HeadProduct``)."""
        if self.head is not None:
            self.head.begin(model.lm_head.weight, rows)

    def run(self, next_B: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Logits ``[B, V]`` of one compiled step (and the head's product where the decoder
        runs it: after ``begin``) on a cache this decoder prepared (``cache``), skipping dynamo's
        full guard check (``skip_guard_eval_unsafe``: only the guards that tell this decoder's
        compiled shapes apart run; ~0.2 ms of a ~2.5 ms CPU step). That is safe here because
        every input comes from ``cache`` and the generation loop: the same model, tensors of
        the compiled shapes, dtypes and devices."""
        self.mark_step()
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            out = self.step(next_B, pos, cache)
        return out if self.head is None else self.head(out)

    def mark_step(self) -> None:
        """Tell CUDA graphs a new step begins (the previous step's outputs were consumed)."""
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_decoder(model) -> CompiledDecoder:  # type: ignore[no-untyped-def]
    """The model's ``CompiledDecoder`` (made on first use, kept while the model lives; made
    anew when the model moved to another device or its head changed kind)."""
    decoder = _DECODERS.get(model)
    if (decoder is None or decoder.device != model.embed.weight.device
            or (decoder.head is not None) != _tunes_head(model)):
        decoder = _DECODERS[model] = CompiledDecoder(model)
    return decoder


def _check_compilable(model) -> None:  # type: ignore[no-untyped-def]
    """``ValueError`` (naming ``compile`` and the layer) for a model whose decode step cannot be
    one graph: every MoE layer needs the built-in grouped experts and a local dispatcher (an
    expert store moves experts on the host between steps, an expert-parallel dispatcher runs
    collectives, ``ModuleExperts`` read their group sizes on the host)."""
    from moeflow.dispatch import LocalDispatcher
    from moeflow.experts import GroupedExperts
    from moeflow.layer.moe import moe_layers

    for i, layer in enumerate(moe_layers(model)):
        if not isinstance(layer.experts, GroupedExperts) or not isinstance(layer.dispatcher, LocalDispatcher):
            raise ValueError(f"compile=True needs every MoE layer to hold GroupedExperts with a LocalDispatcher; MoE "
                             f"layer {i} has {type(layer.experts).__name__} with {type(layer.dispatcher).__name__} "
                             "(offloaded or expert-parallel experts, or experts of your own: generate without compile)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate_compiled(model, prompts, max_new_tokens: int, sampling: SamplingConfig,  # type: ignore[no-untyped-def]
                       generator: torch.Generator | None, clock: Callable[[], float]) -> Generation:
    """``generate(..., compile=True)``; the module docstring says how it differs from the eager
    loop (not in its tokens)."""
    _check_compilable(model)
    V, device = model.config.vocab_size, model.embed.weight.device
    rows = _check_prompts(prompts, V)
    out: list[list[int]] = [[] for _ in rows]
    prompt_tokens = sum(len(r) for r in rows)
    if max_new_tokens == 0:
        return Generation(tokens=out, prefill_tokens=prompt_tokens, prefill_s=0.0, decode_tokens=0, decode_s=0.0)
    B, P, S = len(rows), max(len(r) for r in rows), model.config.max_seq_len
    seq_BS = torch.zeros(B, P + max_new_tokens, dtype=torch.long, device=device)
    seq_BS[:, :P] = torch.tensor([[0] * (P - len(r)) + r for r in rows], dtype=torch.long, device=device)
    pad_B = torch.tensor([P - len(r) for r in rows], dtype=torch.long, device=device)
    capacity = min(S, P + max_new_tokens - 1)  # columns ever fed, as in the eager loop
    start = max(0, P - S)  # a prompt longer than the window is cut to its last S columns
    decoder = compiled_decoder(model)
    cache = decoder.cache(model, (pad_B - start).clamp(min=0), _bucket(capacity, S))
    stop = torch.tensor(sorted(sampling.eos), dtype=torch.long, device=device) if sampling.eos else None
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []

    _sync(device)
    t0 = clock()
    decoder.begin(model, B)  # the head's weight now (a [D, V] copy on some CPUs): counted in the prefill's time
    logits_BV = model.forward_cached(seq_BS[:, start:P], cache)  # the prefill runs eagerly
    filled, cols = P - start, P
    pos = torch.full((), filled, dtype=torch.long, device=device)
    t1 = None
    for step in range(max_new_tokens):
        next_B = sample_next(logits_BV, sampling, generator)
        steps.append(next_B)
        if t1 is None:
            _sync(device)
            t1 = clock()
        if step == max_new_tokens - 1:
            break
        if stop is not None:
            done_B |= torch.isin(next_B, stop)
            # the host looks every few steps (a read is a synchronisation), never inside a step
            if (step + 1) % STOP_CHECK_EVERY == 0 and bool(done_B.all()):
                break
        seq_BS[:, cols] = next_B
        cols += 1
        if filled < capacity:
            logits_BV = decoder.run(next_B, pos, cache)
            pos += 1
            filled += 1
        else:  # the context is longer than max_seq_len: the window slides (eagerly, as generate does)
            cache, logits_BV = _prefill(model, seq_BS[:, :cols], pad_B, capacity)
    tokens_BN = torch.stack(steps, dim=1).tolist()  # the tokens' one read
    _sync(device)
    t2 = clock()
    for b, row in enumerate(tokens_BN):
        for t in row:
            out[b].append(t)
            if t in sampling.eos:
                break
    generated = sum(len(o) for o in out)
    return Generation(tokens=out, prefill_tokens=prompt_tokens, prefill_s=t1 - t0,  # type: ignore[operator]
                      decode_tokens=generated - B, decode_s=t2 - t1)  # type: ignore[operator]


@torch.no_grad()
def generate_uncached(model, idx_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float = 1.0, eos: int | Sequence[int] | None = None,
                      generator: torch.Generator | None = None) -> list[list[int]]:
    """The reference: each step runs the model on the last ``max_seq_len`` tokens of every row
    (``idx [B, S]``, no padding) and picks the next token from the last position. Returns the
    new tokens per row, cut after a stop token, as ``generate`` does."""
    sampling = _check_args(model, max_new_tokens, generator, temperature=temperature, top_k=top_k, top_p=top_p, eos=eos)
    _check_prompts(idx_BS if isinstance(idx_BS, torch.Tensor) else torch.as_tensor(idx_BS, device="cpu"),
                   model.config.vocab_size)  # a host list: checked on the host
    stop = sampling.eos
    out: list[list[int]] = [[] for _ in range(idx_BS.shape[0])]
    done = [False] * idx_BS.shape[0]
    for _ in range(max_new_tokens):
        logits_BV = model(idx_BS[:, -model.config.max_seq_len:])[:, -1, :]
        next_B = sample_next(logits_BV, sampling, generator)
        idx_BS = torch.cat([idx_BS, next_B.unsqueeze(1)], dim=1)
        for b, t in enumerate(next_B.tolist()):
            if not done[b]:
                out[b].append(t)
                done[b] = t in stop
        if all(done):
            break
    return out


def generate_tensor(model, idx_BS: torch.Tensor, max_new_tokens: int, *, use_cache: bool = True,
                    **kwargs: object) -> torch.Tensor:
    """``MoEGPT.generate``: ``idx [B, S]`` followed by the new tokens ``[B, S + n]``; a row that
    stopped early repeats its stop token up to the longest row's ``n``."""
    if not isinstance(idx_BS, torch.Tensor) or idx_BS.dim() != 2 or idx_BS.shape[1] == 0:
        raise ValueError(f"idx must be [batch, seq] with at least one token per row, got "
                         f"{tuple(getattr(idx_BS, 'shape', ()))}")
    if use_cache:
        new = generate(model, idx_BS, max_new_tokens, **kwargs).tokens  # type: ignore[arg-type]
    else:
        new = generate_uncached(model, idx_BS, max_new_tokens, **kwargs)  # type: ignore[arg-type]
    n = max((len(r) for r in new), default=0)
    if n == 0:
        return idx_BS.clone()
    tail = torch.tensor([r + r[-1:] * (n - len(r)) for r in new], dtype=idx_BS.dtype, device=idx_BS.device)
    return torch.cat([idx_BS, tail], dim=1)
