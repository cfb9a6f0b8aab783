"""Compiled decode (``generate(..., compile=True)``, ``moeflow generate --compile``): every step is
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
rounding), inductor writes the graph's wrapper in C++ (``cpp_wrapper``: the kernels and
the expert op are called without a Python line between them; 3.5-8.5% less time a step on
this project's 2-core VM, for ~30% longer compilation), and the experts multiply packed copies
of their fp32 weights with a few-row kernel (``ExpertPacks``, ``moeflow.kernels.packed_cpu``:
the BLAS runs a step's few-row expert products far below the memory's rate; 30-42% less time a
step at batch 8 there; equal up to rounding). Past ``max_seq_len`` the window
slides as in the eager loop (those steps run eagerly: each re-runs the window).

Legend: ``B`` rows, ``S`` columns, ``V`` vocabulary, ``D`` model width.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moeflow.checks import _int
from moeflow.kernels.packed_cpu import PackedExperts, packed_cpu_available, packs_in_use
from moeflow.models.decoding import Generation, SamplingConfig, _check_prompts, _left_padded, _prefill, sample_next

__all__ = ["CompiledDecoder", "compiled_decoder", "STOP_CHECK_EVERY", "HeadProduct", "head_product", "HEAD_LAYOUTS",
           "ExpertPacks", "generate_compiled"]

STOP_CHECK_EVERY = 8  # compiled decode: steps between the host's looks at whether every row stopped
_WARM_UPS = 0  # shapes warmed up by every CompiledDecoder of this process (each adds at most one graph)


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


class ExpertPacks:
    """Packed copies of the expert weights of a CPU compiled decode step
    (``moeflow.kernels.packed_cpu``): its experts multiply a few rows each by weights that come
    from memory, which the BLAS runs far below the memory's rate and the packed few-row kernel
    near it (``docs/benchmarks.md``). ``refresh`` (at the start of every compiled generation)
    packs every MoE layer whose experts take the no-grad grouped path in fp32
    (``GroupedExperts.takes_lean_no_grad``) from the weights as
    they are then, into the packs of the generation before where the shapes allow: always, since
    a write through ``.data`` (an EMA, older training code) changes a weight without a trace;
    about two passes over the expert weights (~9 ms for the bench model's 48 MiB on this
    project's VM), counted in the prefill. ``in_use`` is the context each step runs in. The packs
    cost those weights' memory once more while the model's decoder lives (``clear`` gives it back
    until the next generation); they hold no reference to the weights. Where the kernel does not
    build (``packed_cpu_available``), nothing is packed."""

    def __init__(self) -> None:
        self.packs: dict[int, PackedExperts] = {}  # MoE layer (its index in moe_layers) -> packs

    @staticmethod
    def _packable(experts) -> bool:  # type: ignore[no-untyped-def]
        """The experts' no-grad calls run ``lean_ffn_no_grad``, on fp32 CPU weights (the kernel's)."""
        from moeflow.experts import GroupedExperts

        return (isinstance(experts, GroupedExperts) and experts.takes_lean_no_grad()
                and experts.w_in.dtype == experts.w_out.dtype == torch.float32
                and experts.w_in.device.type == experts.w_out.device.type == "cpu")

    def refresh(self, model) -> None:  # type: ignore[no-untyped-def]
        """Pack the experts of ``model``'s MoE layers as they are now (drop the packs of others)."""
        from moeflow.layer.moe import moe_layers

        packable = {i: layer.experts for i, layer in enumerate(moe_layers(model)) if self._packable(layer.experts)}
        for i in [i for i in self.packs if i not in packable]:
            del self.packs[i]
        if packable and packed_cpu_available():  # (the kernel is built on the first such call)
            for i, experts in packable.items():
                self.packs[i] = PackedExperts.of(experts.w_in, experts.w_out, reuse=self.packs.get(i))

    def clear(self) -> None:
        """Drop the packs (their memory) until the next ``refresh``."""
        self.packs.clear()

    def in_use(self):  # type: ignore[no-untyped-def]
        """The context a step runs in: the packs are found by the experts' no-grad products."""
        return packs_in_use(self.packs.values())


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
    for the rows on this machine); elsewhere the graph is the whole ``decode_step``. On the CPU
    the graph's wrapper is C++ (inductor's ``cpp_wrapper``) and the experts multiply packed
    copies of their weights (``experts``, an ``ExpertPacks``; None on CUDA); on CUDA, CUDA
    graphs replay the step, so no wrapper code runs per step."""

    def __init__(self, model, *, max_caches: int = 4) -> None:  # type: ignore[no-untyped-def]
        self.device = model.embed.weight.device
        self.cuda = self.device.type == "cuda"
        self.head = HeadProduct() if _tunes_head(model) else None
        self.experts = ExpertPacks() if self.device.type == "cpu" else None
        self.step = torch.compile(model.decode_step if self.head is None else model.decode_hidden,
                                  fullgraph=True, dynamic=False, mode="reduce-overhead" if self.cuda else None,
                                  options={"cpp_wrapper": True} if self.device.type == "cpu" else None)
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
        """Compile (where no graph of this shape exists yet) and run the step once per needed call.

        Dynamo keeps at most ``recompile_limit`` (8) graphs of one function and, under
        ``fullgraph=True``, fails past it; the step's function gets one graph per model, batch
        size and capacity, so a process serving its ninth shape would fail. The limit is raised,
        for these calls only, by the shapes every decoder of this process warmed up."""
        global _WARM_UPS
        _WARM_UPS += 1
        tokens_B = torch.zeros(cache.batch, dtype=torch.long, device=self.device)
        pos = torch.zeros((), dtype=torch.long, device=self.device)
        config = torch._dynamo.config
        limit = config.recompile_limit + _WARM_UPS
        with config.patch(recompile_limit=limit, accumulated_recompile_limit=max(config.accumulated_recompile_limit,
                                                                                  limit)):
            for _ in range(3 if self.cuda else 1):  # CUDA graphs record on the second or third call
                self.mark_step()
                self.step(tokens_B, pos, cache)
        cache.reset(pad_B)

    def begin(self, model, rows: int) -> None:  # type: ignore[no-untyped-def]
        """Before a generation of ``rows`` rows: the head's weight as it is now (``HeadProduct``)
        and the experts' packed weights as they are now (``ExpertPacks``, on the CPU)."""
        if self.head is not None:
            self.head.begin(model.lm_head.weight, rows)
        if self.experts is not None:
            self.experts.refresh(model)

    def run(self, next_B: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Logits ``[B, V]`` of one compiled step (and the head's product where the decoder
        runs it: after ``begin``) on a cache this decoder prepared (``cache``), skipping dynamo's
        full guard check (``skip_guard_eval_unsafe``: only the guards that tell this decoder's
        compiled shapes apart run; ~0.2 ms of a ~2.5 ms CPU step). That is safe here because
        every input comes from ``cache`` and the generation loop: the same model, tensors of
        the compiled shapes, dtypes and devices."""
        self.mark_step()
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True), \
                (self.experts.in_use() if self.experts is not None else contextlib.nullcontext()):
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


def generate_compiled(model, prompts, max_new_tokens: int, sampling: SamplingConfig,  # type: ignore[no-untyped-def]
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
    seq_BS, pad_B, P = _left_padded(rows, max_new_tokens, device)
    B, S = len(rows), model.config.max_seq_len
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
