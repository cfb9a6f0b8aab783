"""Cost model of the flat and two-level all-to-all (latency + bytes / bandwidth).

Each rank exchanges ``S`` bytes spread evenly over the ``W = N*L`` ranks (``m = S/W`` per
destination); L ranks per node.

- Flat: L-1 intra-node messages of m bytes and W-L inter-node messages of m bytes; the two link
  kinds work in parallel, each serialises its own messages:
  ``t = max((L-1)(a_intra + m/b_intra), (W-L)(a_inter + m/b_inter))``.
- Two-level: phase 1 sends L-1 intra-node messages of S/L bytes, phase 2 sends N-1 inter-node
  messages of S/N bytes, and the block reorders copy S bytes twice through memory:
  ``t = (L-1)(a_intra + S/L/b_intra) + (N-1)(a_inter + S/N/b_inter) + 2 S / b_mem``.

The flat exchange pays W-L inter-node latencies, the two-level one N-1: at many nodes, or small
messages, the two-level exchange wins; at few nodes its extra phase and copies cost more.
Defaults describe 8-GPU NVLink nodes on 400 Gb/s InfiniBand (one 400 Gb/s NIC per GPU).

The pipelined call (``overlap_degree = n``) is modelled on top (``pipelined_pass_time``,
``predicted_step_time``): n exchanges of ``S/n`` bytes each way per pass, on one link queue,
against n chunks of the compute on one compute queue.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LinkModel", "flat_time", "two_level_time", "crossover", "fit_latency_bandwidth", "pipelined_pass_time",
           "predicted_step_time"]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Per-message latency (s) and per-rank bandwidth (bytes/s) of each link kind."""

    node_size: int = 8
    intra_latency: float = 3e-6  # NVLink + launch
    intra_bandwidth: float = 150e9  # bytes/s per GPU, NVLink 4 all-to-all
    inter_latency: float = 6e-6  # InfiniBand verbs + NCCL proxy
    inter_bandwidth: float = 45e9  # 400 Gb/s NIC per GPU, ~90% achieved
    memory_bandwidth: float = 2.0e12  # HBM, for the reorders

    def __post_init__(self) -> None:
        if self.node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {self.node_size}")
        for name in ("intra_latency", "inter_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("intra_bandwidth", "inter_bandwidth", "memory_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def flat_time(world: int, bytes_per_rank: float, links: LinkModel) -> float:
    L = min(links.node_size, world)
    m = bytes_per_rank / world
    intra = (L - 1) * (links.intra_latency + m / links.intra_bandwidth)
    inter = (world - L) * (links.inter_latency + m / links.inter_bandwidth)
    return max(intra, inter)


def two_level_time(world: int, bytes_per_rank: float, links: LinkModel) -> float:
    L = min(links.node_size, world)
    N = world // L
    S = bytes_per_rank
    phase1 = (L - 1) * (links.intra_latency + S / L / links.intra_bandwidth)
    phase2 = (N - 1) * (links.inter_latency + S / N / links.inter_bandwidth)
    return phase1 + phase2 + 2 * S / links.memory_bandwidth


def crossover(bytes_per_rank: float, links: LinkModel, worlds: list[int]) -> int | None:
    """The smallest world size in ``worlds`` from which the two-level exchange is faster."""
    for w in sorted(worlds):
        if all(two_level_time(v, bytes_per_rank, links) < flat_time(v, bytes_per_rank, links) for v in worlds if v >= w):
            return w
    return None


def fit_latency_bandwidth(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit ``t = a + bytes / b`` minimising the *relative* error (weights ``1/t^2``), so the
    small, latency-bound sizes count as much as the large, bandwidth-bound ones. Returns
    ``(a, b)``."""
    n = len(sizes)
    if n < 2 or len(seconds) != n:
        raise ValueError("need at least two (size, time) pairs of equal length")
    w = [1.0 / (t * t) for t in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sxx
    if slope <= 0:
        raise ValueError("times do not grow with message size; cannot fit a bandwidth")
    return max(my - slope * mx, 0.0), 1.0 / slope


def pipelined_pass_time(exchange_s: float, compute_s: float, degree: int) -> float:
    """One pass (forward or backward) of the pipelined expert-parallel call in ``degree`` chunks:
    each chunk's rows go out in one exchange of ``exchange_s`` and come home in another, and its
    experts compute ``compute_s / degree``. One link queue running exchanges in the order the
    call issues them (every chunk's outbound exchange first, then each chunk's return as soon as
    its compute ends) and one compute queue. Degree 1: ``2 * exchange_s + compute_s``."""
    if degree < 1 or exchange_s < 0 or compute_s < 0:
        raise ValueError(f"need degree >= 1 and times >= 0, got degree={degree}, exchange_s={exchange_s}, "
                         f"compute_s={compute_s}")
    link, arrived = 0.0, []
    for _ in range(degree):
        link += exchange_s
        arrived.append(link)
    computed = 0.0
    for i in range(degree):
        computed = max(computed, arrived[i]) + compute_s / degree
        link = max(link, computed) + exchange_s
    return link


def predicted_step_time(world: int, bytes_per_rank: float, compute_fwd_s: float, compute_bwd_s: float, degree: int,
                        links: LinkModel) -> float:
    """Predicted forward+backward of one expert-parallel layer on ``world`` ranks at overlap
    ``degree``: each chunk's exchange moves ``bytes_per_rank / degree`` per rank, by the
    faster of the flat and two-level exchange (``flat_time``, ``two_level_time``: their
    per-message latencies are what more chunks cost), and each pass pipelines it with its
    compute (``pipelined_pass_time``; backward runs the same exchanges in reverse)."""
    chunk = bytes_per_rank / degree
    exchange = min(flat_time(world, chunk, links), two_level_time(world, chunk, links)) if world > 1 else 0.0
    return pipelined_pass_time(exchange, compute_fwd_s, degree) + pipelined_pass_time(exchange, compute_bwd_s, degree)
