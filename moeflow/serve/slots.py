"""The model side of the serving engine (``moeflow.serve.engine``): fixed decode slots over one KV
cache, a request per row (legend below).

The cache holds ``slots`` rows of ``capacity`` columns, none left-padded: row ``s`` is slot
``s``, and its request's token ``j`` (prompt, then generated) sits in column ``j`` at rotary
position ``j``. A prompt is prefilled in chunks on its row's view (``KVCache.rows``:
``forward_cached`` behind the columns its earlier chunks filled), the last chunk's logits giving
the request's first token. A decode step runs the static step (``decode_step`` with a column
per row, ``pos [n]``) on the row view ``[0, n)``, ``n`` the smallest size of ``sizes`` (powers
of two, and ``slots``) covering the highest decoding slot: a lone request does not pay for
every slot, and there is one compiled graph per size. The rows inside ``[0, n)`` that do not
decode (free, or a prompt half prefilled) take a dummy token at the column they fill next,
which their next write overwrites before anything reads it; their logits are ignored. With
dropless experts (every MoE layer's ``capacity_factor <= 0``) a row's logits do not depend on
the other rows (up to rounding); experts with a capacity would let the dummy rows and the other
requests take capacity from a row, as in any batch.

Compiled (``compile=True``), the step is ``moeflow.models.compiled_decode.CompiledDecoder``'s:
``open`` enters its ``generation`` (the CPU's packed experts and head copy, for the engine's
life) and ``slot_cache`` compiles and warms up one graph per size. Eager, the same static step
runs uncompiled.

Each request samples with its own ``SamplingConfig`` and ``torch.Generator`` (``sample_next``
on its row alone, as ``generate`` draws for a one-row batch), so its tokens do not depend on
the batch. Nothing here reads a tensor on the host: the engine reads the sampled tokens of an
iteration once.

Legend: ``n`` rows of a step (a size of ``sizes``), ``V`` vocabulary, ``S`` columns of a chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from moeflow.models.compiled_decode import _check_compilable, compiled_decoder
from moeflow.models.decoding import SamplingConfig, sample_next

__all__ = ["SlotRow", "Slots", "step_sizes"]


def step_sizes(slots: int) -> tuple[int, ...]:
    """The row counts a decode step runs on: the powers of two below ``slots``, and ``slots``."""
    return tuple(1 << i for i in range(max(0, slots - 1).bit_length()) if 1 << i < slots) + (slots,)


@dataclass(eq=False)
class SlotRow:
    """A request's row: ``slot`` its index, ``prompt`` its token ids, ``filled`` the columns its
    row holds (the prompt's prefilled part, then one more per decode step), ``last`` the token
    to feed next (None until the prompt's last chunk gave the first token), ``sampling`` and
    ``generator`` (None when greedy) how it picks its tokens."""

    slot: int
    prompt: tuple[int, ...]
    sampling: SamplingConfig
    generator: torch.Generator | None
    filled: int = 0
    last: int | None = field(default=None)

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt)


class Slots:
    """``slots`` decode slots of ``capacity`` columns over ``model`` (on its device; the caller
    checked that ``capacity <= max_seq_len``). Use inside ``open`` (on the thread that owns the
    model, under ``torch.no_grad``)."""

    def __init__(self, model, *, slots: int, capacity: int, compile: bool) -> None:  # type: ignore[no-untyped-def]
        if compile:
            _check_compilable(model)
        self.model, self.slots, self.capacity, self.compile = model, slots, capacity, compile
        self.device = model.embed.weight.device
        self.sizes = step_sizes(slots)
        self.decoder = compiled_decoder(model) if compile else None
        self.cache = None
        self.views: dict[int, object] = {}
        self._guarded: set[int] = set()  # sizes whose first compiled step ran with dynamo's guards

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """The cache and, compiled, the decoder's ``generation`` with a graph per step size
        (compiled and warmed up here: seconds a size on the CPU)."""
        if self.decoder is None:
            self.cache = self.model.new_cache(torch.zeros(self.slots, dtype=torch.long, device=self.device),
                                              self.capacity, zeroed=True)
            self.views = {n: self.cache.rows(0, n) for n in self.sizes}
            yield
            return
        self.decoder.prepare(self.model)
        with self.decoder.generation(self.model):
            self.cache, self.views = self.decoder.slot_cache(self.model, self.slots, self.capacity, self.sizes)
            yield

    def prefill(self, row: SlotRow, budget: int) -> tuple[int, torch.Tensor | None]:
        """Prefill up to ``budget`` more prompt tokens of ``row`` on its row's view; the tokens
        taken and, when that ended the prompt, its first token (a 0-dim device tensor)."""
        start = row.filled
        chunk = row.prompt[start:start + budget]
        view = self.cache.rows(row.slot, row.slot + 1)  # type: ignore[union-attr]
        view.length = start
        idx_1S = torch.tensor([chunk], dtype=torch.long, device=self.device)
        logits_1V = self.model.forward_cached(idx_1S, view)
        row.filled += len(chunk)
        if row.prefilling:
            return len(chunk), None
        return len(chunk), sample_next(logits_1V, row.sampling, row.generator)[0]

    def size(self, rows: Sequence[SlotRow]) -> int:
        """The rows of the step that decodes ``rows``: the smallest size covering the highest slot."""
        top = max(r.slot for r in rows) + 1
        return next(n for n in self.sizes if n >= top)

    def step(self, rows: Sequence[SlotRow], others: Sequence[SlotRow]) -> torch.Tensor:
        """One decode step of ``rows`` (each with its ``last`` token; ``others``: the rows
        prefilling, whose columns a dummy write must spare): their next tokens ``[len(rows)]``
        on the device, in the order of ``rows``; each row's ``filled`` grows by one."""
        n = self.size(rows)
        tokens, cols = [0] * n, [0] * n
        for r in others:
            if r.slot < n:
                cols[r.slot] = r.filled  # (overwritten by its next chunk before anything reads it)
        for r in rows:
            tokens[r.slot], cols[r.slot] = r.last, r.filled  # type: ignore[call-overload]
        next_n = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos_n = torch.tensor(cols, dtype=torch.long, device=self.device)
        view = self.views[n]
        if self.decoder is None:
            logits_nV = self.model.decode_step(next_n, pos_n, view)
        else:
            logits_nV = self.decoder.run(next_n, pos_n, view, guarded=n not in self._guarded)
            self._guarded.add(n)
        for r in rows:
            r.filled += 1
        return self.sample(logits_nV, rows)

    @staticmethod
    def sample(logits_nV: torch.Tensor, rows: Sequence[SlotRow]) -> torch.Tensor:
        """Each row's next token from its logits row (``logits_nV[row.slot]``), with its own
        sampling and generator: the greedy rows by one argmax, the others one draw each."""
        slot_R = torch.tensor([r.slot for r in rows], dtype=torch.long, device=logits_nV.device)
        logits_RV = logits_nV.index_select(0, slot_R)
        out_R = logits_RV.argmax(-1)
        for i, r in enumerate(rows):
            if not r.sampling.greedy:
                out_R[i:i + 1] = sample_next(logits_RV[i:i + 1], r.sampling, r.generator)
        return out_R
