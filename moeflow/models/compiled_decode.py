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
between steps. Past ``max_seq_len`` the window slides as in the eager loop (those steps run
eagerly: each re-runs the window). The engine of ``moeflow serve`` decodes its slots through
the same step (``CompiledDecoder.slot_cache``): one cache of ``slots`` rows, a graph per row
view ``[0, n)`` with a column per row (``pos [n]``: the slots hold requests of different
lengths).

On the CPU three more things, each equal up to rounding: the head's product runs after the
compiled graph in one fixed layout (``HeadProduct``: the few-row kernel over a packed copy of
an fp32 head); inductor writes the graph's wrapper in C++ (``cpp_wrapper``: the kernels and the
packed ops are called without a Python line between them); and for the length of each
generation every MoE layer whose experts ``packable`` accepts computes with a
``PackedCPUExperts`` in their place, and every plain fp32 ``nn.Linear`` but the head
(``packable_linear``: the attention's projections, dense and shared FFNs, routers) with a
``PackedCPULinear`` (packed copies of the weights and a few-row kernel: ``moeflow.experts.
packed``, ``moeflow.models.packed_dense``), all put back in a ``finally``.

A compiled step runs with dynamo's guards skipped (``skip_guard_eval_unsafe``), so what it was
traced for must hold whenever it runs: the caches are kept per shape *and* per the state the
step was traced in (the model's dtype, every module's ``training`` flag, which layers have
packed experts: ``_traced_state``), a new state warming up (and compiling) before its first
step, and the first step of every generation runs the guards in full, catching any other
change (a parameter replaced by one of another shape, say) by recompiling.

Legend: ``B`` rows, ``S`` columns, ``V`` vocabulary, ``D`` model width.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from moeflow.dispatch import LocalDispatcher
from moeflow.experts import GroupedExperts
from moeflow.experts.packed import PackedCPUExperts, packable
from moeflow.kernels.packed_cpu import packed_cpu_available
from moeflow.layer.moe import moe_layers
from moeflow.models.decoding import Generation, SamplingConfig, _check_prompts, _left_padded, _prefill, sample_next
from moeflow.models.packed_dense import HeadProduct, PackedCPULinear, packable_linear

__all__ = ["CompiledDecoder", "compiled_decoder", "STOP_CHECK_EVERY", "HeadProduct", "generate_compiled"]

STOP_CHECK_EVERY = 8  # compiled decode: steps between the host's looks at whether every row stopped
_WARM_UPS = 0  # shapes warmed up by every CompiledDecoder of this process (each adds at most one graph)


def _bucket(columns: int, max_seq_len: int) -> int:
    """The cache capacity of a compiled generation needing ``columns``: the next power of two
    (at least 16), at most ``max_seq_len``; calls of similar lengths share one compilation."""
    return min(max_seq_len, max(16, 1 << max(0, columns - 1).bit_length()))


def _head_outside(model) -> bool:  # type: ignore[no-untyped-def]
    """Whether the compiled step leaves the head to a ``HeadProduct`` (a plain bias-free
    ``nn.Linear`` head on the CPU; on CUDA the head stays inside the graph CUDA graphs replay)."""
    head = model.lm_head
    return model.embed.weight.device.type == "cpu" and type(head) is torch.nn.Linear and head.bias is None


def _traced_state(model, packed: tuple) -> tuple:  # type: ignore[no-untyped-def]
    """What a compiled step depends on besides its shapes and is not read from its inputs each
    call: the model's dtype, every module's ``training`` flag (dropout, router noise and
    balance counters), and the MoE layers and linears that are packed (``packed``)."""
    return model.embed.weight.dtype, tuple(m.training for m in model.modules()), packed


class CompiledDecoder:
    """One model's compiled static decode step (``MoEGPT.decode_step`` through
    ``torch.compile(fullgraph=True)``, with CUDA graphs on CUDA) and the caches it runs on.

    A cache per batch size, capacity and traced state (``_traced_state``) is kept and reused by
    later calls (zeroed each time): CUDA graphs replay on fixed addresses, and the cache is what
    the step writes. At most ``max_caches`` are kept (the least recently used go).
    ``compilations`` counts the shapes and states prepared so far (each compiled and warmed up
    on first use, before any timing).

    On the CPU, with a plain ``nn.Linear`` head, the compiled graph is ``MoEGPT.decode_hidden``
    and the head's product runs after it through ``head`` (a ``HeadProduct``); elsewhere the
    graph is the whole ``decode_step``. On the CPU the graph's wrapper is C++ (inductor's
    ``cpp_wrapper``) and ``generation`` puts packed experts and linears in place (``stand_ins``,
    one per MoE layer index, ``linear_stand_ins``, one per linear's name; kept between
    generations so that the compiled step reads the same buffers, packed again each time); on
    CUDA, CUDA graphs replay the step, so no wrapper code runs per step. While a generation
    runs, the model holds stand-ins instead of those modules: it must not be used by another
    thread then."""

    def __init__(self, model, *, max_caches: int = 4) -> None:  # type: ignore[no-untyped-def]
        self.device = model.embed.weight.device
        self.cuda = self.device.type == "cuda"
        self.head = HeadProduct() if _head_outside(model) else None
        self.stand_ins: dict[int, PackedCPUExperts] = {}  # MoE layer index -> its packed experts (CPU)
        self.linear_stand_ins: dict[str, PackedCPULinear] = {}  # a linear's qualified name -> its stand-in (CPU)
        self.step = torch.compile(model.decode_step if self.head is None else model.decode_hidden,
                                  fullgraph=True, dynamic=False, mode="reduce-overhead" if self.cuda else None,
                                  options={"cpp_wrapper": True} if self.device.type == "cpu" else None)
        self.caches: dict[tuple, object] = {}
        self.max_caches = max_caches
        self.compilations = 0
        self.state: tuple | None = None  # the traced state of the generation under way

    @contextlib.contextmanager
    def generation(self, model) -> Iterator[None]:  # type: ignore[no-untyped-def]
        """The length of one generation: on the CPU, packed experts in place of every MoE layer's
        experts that ``packable`` accepts (packed from the weights as they are now; where the
        kernel does not build, none) and the head's weight as it is now; all put back, and the
        head's copy dropped, on the way out, whatever happens inside."""
        swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (parent, attribute, original)
        try:
            packed = self._pack(model, swapped) if self.device.type == "cpu" else ()
            if self.head is not None:
                self.head.begin(model.lm_head.weight)
            self.state = _traced_state(model, packed)
            yield
        finally:
            self.state = None
            for parent, name, original in reversed(swapped):
                setattr(parent, name, original)
            if self.head is not None:
                self.head.end()

    def prepare(self, model) -> None:  # type: ignore[no-untyped-def]
        """What the first generation needs once, before its clock starts: on the CPU, with
        anything to pack (experts, linears, the head), the packed kernel built
        (``packed_cpu_available``: seconds, once per machine, like a compilation)."""
        if self.device.type != "cpu":
            return
        if (self.head is not None or any(packable(layer.experts) for layer in moe_layers(model))
                or any(packable_linear(m) for m in model.modules())):
            packed_cpu_available()

    def _pack(self, model, swapped: list) -> tuple:  # type: ignore[no-untyped-def]
        """Put a ``PackedCPUExperts`` in place of each packable layer's experts and a
        ``PackedCPULinear`` in place of each packable linear but the head (recording the swaps
        in ``swapped``); the indices of those layers and the names of those linears."""
        layers = moe_layers(model)
        wanted = [i for i, layer in enumerate(layers) if packable(layer.experts)]
        linears = [name for name, m in model.named_modules() if m is not model.lm_head and packable_linear(m)]
        for i in [i for i in self.stand_ins if i not in wanted]:
            del self.stand_ins[i]  # (its memory)
        for name in [n for n in self.linear_stand_ins if n not in linears]:
            del self.linear_stand_ins[name]
        if not (wanted or linears) or not packed_cpu_available():  # (the kernel is built on the first such call)
            return ()
        for i in wanted:
            experts = layers[i].experts
            stand_in = self.stand_ins.get(i)
            if stand_in is None:
                stand_in = self.stand_ins[i] = PackedCPUExperts(experts)
            else:
                stand_in.repack(experts)
            swapped.append((layers[i], "experts", experts))
            layers[i].experts = stand_in
        for name in linears:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, attr)
            stand_in = self.linear_stand_ins.get(name)
            if stand_in is None:
                stand_in = self.linear_stand_ins[name] = PackedCPULinear(linear)
            else:
                stand_in.repack(linear)
            swapped.append((parent, attr, linear))
            setattr(parent, attr, stand_in)
        return tuple(wanted), tuple(linears)

    def cache(self, model, pad_B: torch.Tensor, capacity: int):  # type: ignore[no-untyped-def]
        """A zeroed cache of ``capacity`` columns for these rows (``pad_B``), with the step
        compiled and warmed up for its shape and the traced state (inside ``generation``)."""
        if self.state is None:
            raise RuntimeError("CompiledDecoder.cache runs inside CompiledDecoder.generation")
        key = (pad_B.shape[0], capacity, self.state)
        cache = self.caches.pop(key, None)
        if cache is None:
            cache = model.new_cache(pad_B, capacity, zeroed=True)
            self._prepare(model, cache, per_row=False)
            while len(self.caches) >= self.max_caches:
                self.caches.pop(next(iter(self.caches)))
        else:
            cache.reset(pad_B)
        self.caches[key] = cache  # the most recently used last
        return cache

    def slot_cache(self, model, slots: int, capacity: int, sizes: Sequence[int]):  # type: ignore[no-untyped-def]
        """The decode slots of ``moeflow serve``: a zeroed cache of ``slots`` rows and
        ``capacity`` columns, no row padded, and for each ``n`` of ``sizes`` its row view ``[0,
        n)`` (``KVCache.rows``), the step compiled and warmed up for each view with a column per
        row (``pos [n]``), inside ``generation``. Made anew on every call and not kept here: its
        engine keeps it (and the views: CUDA graphs replay on their addresses)."""
        if self.state is None:
            raise RuntimeError("CompiledDecoder.slot_cache runs inside CompiledDecoder.generation")
        cache = model.new_cache(torch.zeros(slots, dtype=torch.long, device=self.device), capacity, zeroed=True)
        views = {n: cache.rows(0, n) for n in sizes}
        for view in views.values():
            self._prepare(model, view, per_row=True)
        return cache, views

    def _prepare(self, model, cache, *, per_row: bool) -> None:  # type: ignore[no-untyped-def]
        """Fix the cache's addresses (CUDA graphs), compile and warm up the step for it."""
        if self.cuda:  # the step writes into the cache: CUDA graphs need it at fixed addresses
            for t in (*cache.k, *cache.v):
                torch._dynamo.mark_static_address(t)
        try:
            self._warm_up(model, cache, cache.pad_B.clone(), per_row=per_row)
        except torch._dynamo.exc.TorchDynamoException as err:  # e.g. a host read in a custom layer
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"compile=True: this model's decode step does not compile as one graph ({first}); "
                             "generate without compile") from err
        self.compilations += 1

    def _warm_up(self, model, cache, pad_B: torch.Tensor, *, per_row: bool) -> None:  # type: ignore[no-untyped-def]
        """Compile (where no graph of this shape and state exists yet) and run the step once per
        needed call, guards evaluated, with ``pos`` 0-dim or a column per row (``per_row``); the
        model's buffers (a router's balance counters, which a step in training mode adds to) and
        the cache are as before afterwards."""
        tokens_B = torch.zeros(cache.batch, dtype=torch.long, device=self.device)
        pos = torch.zeros(cache.batch if per_row else (), dtype=torch.long, device=self.device)
        saved = [(b, b.clone()) for m in model.modules() if not isinstance(m, (PackedCPUExperts, PackedCPULinear))
                 for b in m.buffers(recurse=False)]
        with _recompile_room(warm_up=True):
            for _ in range(3 if self.cuda else 1):  # CUDA graphs record on the second or third call
                self.mark_step()
                self.step(tokens_B, pos, cache)
        with torch.no_grad():
            for b, before in saved:
                b.copy_(before)
        cache.reset(pad_B)

    def run(self, next_B: torch.Tensor, pos: torch.Tensor, cache, *,  # type: ignore[no-untyped-def]
            guarded: bool = False) -> torch.Tensor:
        """Logits ``[B, V]`` of one compiled step (and the head's product where the decoder
        runs it) on a cache this decoder prepared (``cache``), inside ``generation``. Dynamo's
        guards are skipped (``skip_guard_eval_unsafe``: only those that tell this decoder's
        compiled graphs apart run) unless ``guarded`` (the first step of every generation: a
        change the traced state does not name recompiles there, not silently runs a stale
        graph). Within a generation every input comes from ``cache``, the generation loop and
        the model as ``generation`` left it: the tensors of the compiled shapes, dtypes and
        devices."""
        self.mark_step()
        if guarded:
            with _recompile_room(warm_up=False):
                out = self.step(next_B, pos, cache)
        else:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                out = self.step(next_B, pos, cache)
        return out if self.head is None else self.head(out)

    def mark_step(self) -> None:
        """Tell CUDA graphs a new step begins (the previous step's outputs were consumed)."""
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()


@contextlib.contextmanager
def _recompile_room(*, warm_up: bool) -> Iterator[None]:
    """Dynamo keeps at most ``recompile_limit`` (8) graphs of one function and, under
    ``fullgraph=True``, fails past it; the step's function gets one graph per model, batch
    size, capacity and traced state, so a process serving its ninth would fail. The limit is
    raised, for the decoders' own calls only, by the warm-ups of every decoder of this process
    (``warm_up``: this call is one more), and by one for the guarded first step of a
    generation, which recompiles where something changed that the traced state does not name."""
    global _WARM_UPS
    _WARM_UPS += warm_up
    config = torch._dynamo.config
    limit = config.recompile_limit + _WARM_UPS + 1
    with config.patch(recompile_limit=limit, accumulated_recompile_limit=max(config.accumulated_recompile_limit, limit)):
        yield


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_decoder(model) -> CompiledDecoder:  # type: ignore[no-untyped-def]
    """The model's ``CompiledDecoder`` (made on first use, kept while the model lives; made
    anew when the model moved to another device or its head changed kind)."""
    decoder = _DECODERS.get(model)
    if (decoder is None or decoder.device != model.embed.weight.device
            or (decoder.head is not None) != _head_outside(model)):
        decoder = _DECODERS[model] = CompiledDecoder(model)
    return decoder


def _check_compilable(model) -> None:  # type: ignore[no-untyped-def]
    """``ValueError`` (naming ``compile`` and the layer) for a model whose decode step cannot be
    one graph: every MoE layer needs the built-in grouped experts and a local dispatcher (an
    expert store moves experts on the host between steps, an expert-parallel dispatcher runs
    collectives, ``ModuleExperts`` read their group sizes on the host)."""
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
    stop = torch.tensor(sorted(sampling.eos), dtype=torch.long, device=device) if sampling.eos else None
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []

    decoder.prepare(model)
    _sync(device)
    t_pack = clock()
    with decoder.generation(model):  # packs and the head's copy: counted in the prefill's time
        packing_s = clock() - t_pack
        cache = decoder.cache(model, (pad_B - start).clamp(min=0), _bucket(capacity, S))  # (compiles: not timed)
        _sync(device)
        t0 = clock()
        logits_BV = model.forward_cached(seq_BS[:, start:P], cache)  # the prefill runs eagerly
        filled, cols = P - start, P
        pos = torch.full((), filled, dtype=torch.long, device=device)
        t1, guarded = None, True  # the first compiled step runs dynamo's guards in full
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
                logits_BV = decoder.run(next_B, pos, cache, guarded=guarded)
                guarded = False
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
    return Generation(tokens=out, prefill_tokens=prompt_tokens, prefill_s=t1 - t0 + packing_s,  # type: ignore[operator]
                      decode_tokens=generated - B, decode_s=t2 - t1)  # type: ignore[operator]
