"""The exchanges of a pipelined call, chunk by chunk (legend: moeflow.types, plus ``n`` chunks).

The pipelined call (``moeflow.parallel.strategies.pipeline``) sends this rank's rows
chunk-major in one ``[M, D]`` tensor (chunk ``i``: rows ``[off[i], off[i+1])``) and gets their
outputs home in the same order, then sums them per token. ``chunked_exchange`` gives it:

- ``scatter(x_MD)``: every chunk's exchange starts now; ``receive(i)`` waits for chunk ``i`` and
  returns the rows this rank received in it (by source rank);
- ``send_home(i, y_RD)``: chunk ``i``'s outputs start home (the reverse routes); ``home()``
  waits for the last and returns all of them as one ``[M, D]`` tensor, chunk-major.

Over the flat exchange (``FlatChunks``) each chunk's all-to-all reads its slice of ``x_MD`` and
writes its slice of one home buffer (``moeflow.parallel.comm.start_all_to_all_into``), and the
backward does the same with the gradients: no ``[M, D]`` tensor is ever split or joined by a
copy, as in the unchunked call. Backward runs asynchronously too: a chunk's gradient starts
back as soon as autograd reaches it, and the home gradient's chunks start back last chunk
first, the order in which autograd (latest node first) needs them. Every rank takes the same
steps in the same order, so the collectives match. Any other exchange (the two-level one) runs
its own ``start``/``relay``/``finish`` per chunk (``PhasedChunks``): one split and one join
of the ``[M, D]`` rows (and of their gradients) more.
"""

from __future__ import annotations

import torch

from moeflow.parallel.comm import start_all_to_all_into
from moeflow.parallel.exchange.alltoall import FlatExchange

__all__ = ["chunked_exchange", "FlatChunks", "PhasedChunks"]

Counts = list[list[int]]


def chunked_exchange(exchange, counts_nWW: list[Counts]):  # type: ignore[no-untyped-def]
    """The chunked exchange for ``exchange`` (flat or two-level) and ``counts_nWW[i][s][d]``,
    the rows rank ``s`` sends rank ``d`` in chunk ``i`` (every rank's view)."""
    if isinstance(exchange, FlatExchange):
        return FlatChunks(exchange, counts_nWW)
    return PhasedChunks(exchange, counts_nWW)


def _offsets(sizes: list[int]) -> list[int]:
    off = [0]
    for s in sizes:
        off.append(off[-1] + s)
    return off


class _Route:
    """One direction of the chunks' exchanges and its in-flight state: per chunk the rows sent
    to and received from every rank; ``off``: chunk offsets of the one-tensor side."""

    def __init__(self, group, sends: list[list[int]], recvs: list[list[int]], one_side: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
        self.group, self.sends, self.recvs = group, sends, recvs
        self.off = _offsets([sum(c) for c in one_side])
        n = len(sends)
        self.works: list = [None] * n
        self.back_works: list = [None] * n
        self.back: list = [None] * n  # backward's per-chunk gradients (home route)
        self.buf: torch.Tensor | None = None  # the one-tensor side (home rows, or the rows' gradient)

    def one_side(self, i: int) -> slice:
        return slice(self.off[i], self.off[i + 1])


class _ScatterStart(torch.autograd.Function):
    """``x_MD``'s chunks start out; returns the n not-yet-filled receive buffers (only
    ``_ScatterWait`` may read them). Backward: every chunk's gradient was sent back into its
    slice of one buffer by ``_ScatterWait.backward``; wait for them all and return it."""

    @staticmethod
    def forward(ctx, x_MD, route):  # type: ignore[override]
        x_MD = x_MD.contiguous()
        outs = []
        for i in range(len(route.sends)):
            out = x_MD.new_empty((sum(route.recvs[i]), *x_MD.shape[1:]))
            route.works[i] = start_all_to_all_into(out, x_MD[route.one_side(i)], route.sends[i], route.recvs[i],
                                                   route.group, "pipelined exchange")
            outs.append(out)
        ctx.route = route
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        route = ctx.route
        for i, g in enumerate(grads):  # a chunk autograd never reached sends its (zero) gradient now
            if route.back_works[i] is None:
                _send_back(route, i, g)
        for w in route.back_works:
            w.wait()
        grad, route.buf, route.back_works = route.buf, None, [None] * len(route.sends)
        return grad, None


def _send_back(route: _Route, i: int, g: torch.Tensor) -> None:
    """Start chunk ``i``'s gradient back into its slice of the one gradient buffer."""
    g = g.contiguous()
    if route.buf is None:
        route.buf = g.new_empty((route.off[-1], *g.shape[1:]))
    route.back_works[i] = start_all_to_all_into(route.buf[route.one_side(i)], g, route.recvs[i], route.sends[i],
                                                route.group, "pipelined exchange")


class _ScatterWait(torch.autograd.Function):
    """Wait for chunk ``i``'s rows and pass its buffer on (a view). Backward: start the chunk's
    gradient back (``_send_back``) and pass it through to ``_ScatterStart``."""

    @staticmethod
    def forward(ctx, out_RD, route, i):  # type: ignore[override]
        route.works[i].wait()
        route.works[i] = None
        ctx.route, ctx.i = route, i
        return out_RD.view_as(out_RD)

    @staticmethod
    def backward(ctx, grad_RD):  # type: ignore[override]
        _send_back(ctx.route, ctx.i, grad_RD)
        return grad_RD, None, None


class _HomeStart(torch.autograd.Function):
    """Chunk ``i``'s outputs start home into their slice of the one home buffer; returns an
    empty token for ``_HomeFinish``. Backward: wait for the chunk's gradient, which
    ``_HomeFinish.backward`` started back, and return it."""

    @staticmethod
    def forward(ctx, y_RD, route, i):  # type: ignore[override]
        if route.buf is None:
            route.buf = y_RD.new_empty((route.off[-1], *y_RD.shape[1:]))
        route.works[i] = start_all_to_all_into(route.buf[route.one_side(i)], y_RD.contiguous(), route.sends[i],
                                               route.recvs[i], route.group, "pipelined exchange")
        ctx.route, ctx.i = route, i
        return y_RD.new_empty(0)

    @staticmethod
    def backward(ctx, grad_token):  # type: ignore[override]
        route, i = ctx.route, ctx.i
        route.back_works[i].wait()
        grad, route.back[i], route.back_works[i] = route.back[i], None, None
        return grad, None, None


class _HomeFinish(torch.autograd.Function):
    """Wait for every chunk's outputs and return the home buffer. Backward: start every
    chunk's slice of the gradient back (last chunk first: autograd needs it first)."""

    @staticmethod
    def forward(ctx, route, *tokens):  # type: ignore[override]
        for w in route.works:
            w.wait()
        home, route.buf, route.works = route.buf, None, [None] * len(route.sends)
        ctx.route = route
        return home

    @staticmethod
    def backward(ctx, grad_MD):  # type: ignore[override]
        route = ctx.route
        grad_MD = grad_MD.contiguous()
        for i in reversed(range(len(route.sends))):
            route.back[i] = grad_MD.new_empty((sum(route.sends[i]), *grad_MD.shape[1:]))
            route.back_works[i] = start_all_to_all_into(route.back[i], grad_MD[route.one_side(i)], route.recvs[i],
                                                        route.sends[i], route.group, "pipelined exchange")
        return (None, *(grad_MD.new_zeros(0) for _ in route.sends))


class FlatChunks:
    """The chunks over one flat all-to-all group (module docstring)."""

    def __init__(self, exchange: FlatExchange, counts_nWW: list[Counts]) -> None:
        r, W = exchange.rank, exchange.world
        sends = [c[r] for c in counts_nWW]
        recvs = [[c[s][r] for s in range(W)] for c in counts_nWW]
        self.out = _Route(exchange.group, sends, recvs, one_side=sends)
        self.home_route = _Route(exchange.group, recvs, sends, one_side=sends)
        self.received: tuple = ()
        self.tokens: list[torch.Tensor] = []

    def scatter(self, x_MD: torch.Tensor) -> None:
        self.received = _ScatterStart.apply(x_MD, self.out)

    def receive(self, i: int) -> torch.Tensor:
        return _ScatterWait.apply(self.received[i], self.out, i)

    def send_home(self, i: int, y_RD: torch.Tensor) -> None:
        self.tokens.append(_HomeStart.apply(y_RD, self.home_route, i))

    def home(self) -> torch.Tensor:
        return _HomeFinish.apply(self.home_route, *self.tokens)


class PhasedChunks:
    """The chunks over any exchange with ``start``/``relay``/``finish`` (the two-level one):
    chunk ``i+1``'s next phase is launched before chunk ``i``'s rows are used."""

    def __init__(self, exchange, counts_nWW: list[Counts]) -> None:  # type: ignore[no-untyped-def]
        self.ex, self.counts = exchange, counts_nWW
        self.sizes = [sum(c[exchange.rank]) for c in counts_nWW]
        self.started: list = []
        self.homes: list = []

    def scatter(self, x_MD: torch.Tensor) -> None:
        # one split (its backward is one join), not n slices (each slice's backward would
        # zero-fill and add a whole [M, D] gradient)
        self.started = [self.ex.start(part, self.counts[i]) for i, part in enumerate(x_MD.split(self.sizes))]
        self.started[0] = self.ex.relay(self.started[0])

    def receive(self, i: int) -> torch.Tensor:
        if i + 1 < len(self.started):
            self.started[i + 1] = self.ex.relay(self.started[i + 1])
        return self.ex.finish(self.started[i])

    def send_home(self, i: int, y_RD: torch.Tensor) -> None:
        self.homes.append(self.ex.start(y_RD, [list(col) for col in zip(*self.counts[i])]))  # reverse routes
        if i:  # the previous chunk's outputs came home while this one was computed
            self.homes[i - 1] = self.ex.finish(self.homes[i - 1])

    def home(self) -> torch.Tensor:
        self.homes[-1] = self.ex.finish(self.homes[-1])
        return torch.cat(self.homes) if len(self.homes) > 1 else self.homes[0]
