"""The all-to-all cost model (``moeflow.parallel.placement.costmodel``, pure arithmetic)."""

from __future__ import annotations

import pytest

from moeflow.parallel.placement.costmodel import (
    LinkModel,
    crossover,
    fit_latency_bandwidth,
    flat_time,
    pipelined_pass_time,
    predicted_step_time,
    two_level_time,
)

pytestmark = pytest.mark.unit


def test_flat_and_two_level_formulas_by_hand():
    links = LinkModel(node_size=4, intra_latency=1.0, intra_bandwidth=10.0, inter_latency=2.0,
                      inter_bandwidth=5.0, memory_bandwidth=100.0)
    W, S = 16, 160.0  # m = 10 bytes per destination, 4 nodes of 4
    assert flat_time(W, S, links) == pytest.approx(max(3 * (1 + 10 / 10), 12 * (2 + 10 / 5)))
    assert two_level_time(W, S, links) == pytest.approx(3 * (1 + 40 / 10) + 3 * (2 + 40 / 5) + 2 * 160 / 100)


def test_two_level_wins_at_scale_and_loses_on_few_nodes():
    links = LinkModel()
    S = 64 * 2**20
    assert two_level_time(16, S, links) > flat_time(16, S, links)
    assert two_level_time(2048, S, links) < flat_time(2048, S, links)
    worlds = [16, 32, 64, 128, 256, 512, 1024, 2048]
    w = crossover(S, links, worlds)
    assert w is not None and 16 < w <= 2048
    assert all(two_level_time(v, S, links) < flat_time(v, S, links) for v in worlds if v >= w)
    # smaller messages are latency-bound: the crossover comes earlier
    assert crossover(S / 64, links, worlds) <= w


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e4, 1e5, 1e6]
    a, b = fit_latency_bandwidth(sizes, [5e-5 + s / 2e9 for s in sizes])
    assert a == pytest.approx(5e-5, rel=1e-9) and b == pytest.approx(2e9, rel=1e-9)
    with pytest.raises(ValueError):
        fit_latency_bandwidth([1.0], [1.0])
    with pytest.raises(ValueError):
        LinkModel(inter_bandwidth=0)


def test_pipelined_pass_and_predicted_step():
    """The pipeline model by hand: degree 1 is out + compute + home; with more chunks the
    compute hides all but the first chunk's way out and the last chunk's way home, when the
    exchange is short next to the compute; a long exchange is what the link queue takes."""
    from moeflow.parallel.placement.costmodel import pipelined_pass_time, predicted_step_time

    assert pipelined_pass_time(1.0, 6.0, 1) == pytest.approx(8.0)
    # 2 chunks, x=0.5, c=3 each: out [0,.5] [.5,1]; compute [.5,3.5] [3.5,6.5]; home [3.5,4] [6.5,7]
    assert pipelined_pass_time(0.5, 6.0, 2) == pytest.approx(7.0)
    # exchange-bound: 3 chunks of x=2, c=1 each: the link runs 6 exchanges back to back
    assert pipelined_pass_time(2.0, 3.0, 3) == pytest.approx(12.0)
    assert pipelined_pass_time(0.0, 3.0, 4) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="degree"):
        pipelined_pass_time(1.0, 1.0, 0)
    links = LinkModel()
    S = 64 * 2**20
    x1 = min(flat_time(8, S, links), two_level_time(8, S, links))
    x2 = min(flat_time(8, S / 2, links), two_level_time(8, S / 2, links))
    assert predicted_step_time(8, S, 0.01, 0.02, 1, links) == pytest.approx(4 * x1 + 0.03)
    assert predicted_step_time(8, S, 0.01, 0.02, 2, links) == pytest.approx(
        pipelined_pass_time(x2, 0.01, 2) + pipelined_pass_time(x2, 0.02, 2))
    assert predicted_step_time(1, S, 0.01, 0.02, 2, links) == pytest.approx(0.03)  # one rank: no exchange
    # at 64 GPUs (8 nodes) the exchange is slower: degree 2 gains more there than at 8
    gain = lambda w: predicted_step_time(w, S, 0.01, 0.02, 1, links) - predicted_step_time(w, S, 0.01, 0.02, 2, links)  # noqa: E731
    assert gain(64) > gain(8) > 0


def _random_links(gen, node_size: int) -> LinkModel:  # type: ignore[no-untyped-def]
    import torch

    a = (10 ** (torch.rand(5, generator=gen, dtype=torch.float64) * 4 - 2)).tolist()
    return LinkModel(node_size=node_size, intra_latency=a[0], intra_bandwidth=a[1] * 100, inter_latency=a[2],
                     inter_bandwidth=a[3] * 10, memory_bandwidth=a[4] * 1000)


def test_one_node_pays_only_its_intra_node_messages():
    """A world within one node (any node size, random links): the flat exchange is W-1 messages
    of S/W bytes on the intra-node link, and the two-level one the same plus its two copies of S
    bytes (one node: no inter-node phase). With node_size=1 every peer is on another node: W-1
    inter-node messages (phase 1 is empty)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        W = int(torch.randint(2, 9, (), generator=gen))
        links = _random_links(gen, node_size=int(torch.randint(W, 17, (), generator=gen)))
        S = float(torch.rand((), generator=gen, dtype=torch.float64)) * 1e4
        one_node = (W - 1) * (links.intra_latency + S / W / links.intra_bandwidth)
        assert flat_time(W, S, links) == pytest.approx(one_node, rel=1e-12)
        assert two_level_time(W, S, links) == pytest.approx(one_node + 2 * S / links.memory_bandwidth, rel=1e-12)
        solo = _random_links(gen, node_size=1)  # a node of one rank is allowed
        assert flat_time(W, S, solo) == pytest.approx((W - 1) * (solo.inter_latency + S / W / solo.inter_bandwidth),
                                                      rel=1e-12)
        assert two_level_time(W, S, solo) == pytest.approx(
            (W - 1) * (solo.inter_latency + S / W / solo.inter_bandwidth) + 2 * S / solo.memory_bandwidth, rel=1e-12)


def test_link_model_limits_both_sides():
    """Latencies may be 0 and bandwidths any positive value (below 1 byte/s too), a node one rank;
    a negative latency, a bandwidth of 0 or below and a node of no rank are refused, each field
    on its own."""
    LinkModel(node_size=1, intra_latency=0.0, inter_latency=0.0, intra_bandwidth=0.5, inter_bandwidth=0.25,
              memory_bandwidth=1.0)
    with pytest.raises(ValueError, match="node_size"):
        LinkModel(node_size=0)
    for name in ("intra_latency", "inter_latency"):
        with pytest.raises(ValueError, match=name):
            LinkModel(**{name: -1e-9})
    for name in ("intra_bandwidth", "inter_bandwidth", "memory_bandwidth"):
        for bad in (0.0, -1.0):
            with pytest.raises(ValueError, match=name):
                LinkModel(**{name: bad})


def test_crossover_needs_the_two_level_exchange_strictly_faster():
    """Where both exchanges cost the same (no bytes, no intra-node latency, one node: both 0),
    the two-level exchange is never 'faster': no crossover."""
    links = LinkModel(node_size=8, intra_latency=0.0)
    assert flat_time(4, 0.0, links) == two_level_time(4, 0.0, links) == 0.0
    assert crossover(0.0, links, [2, 4, 8]) is None


def test_fit_minimises_the_relative_error():
    """On noisy timings over four decades of sizes the fit is the least-squares line of the
    relative errors (each point weighted 1/t^2, solved here directly); the unweighted line
    differs. Two points are enough (the line through them); flat timings are refused with a
    ValueError, and fewer than two points or unequal lengths too."""
    import torch

    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        sizes = (10 ** (torch.rand(12, generator=gen, dtype=torch.float64) * 4 + 2)).sort().values
        a, b = 1e-5 * (1 + float(torch.rand((), generator=gen))), 1e9 * (1 + float(torch.rand((), generator=gen)))
        t = (a + sizes / b) * (1 + 0.2 * (torch.rand(12, generator=gen, dtype=torch.float64) - 0.5))
        fa, fb = fit_latency_bandwidth(sizes.tolist(), t.tolist())
        A = torch.stack([torch.ones_like(sizes), sizes], 1)
        ref = torch.linalg.lstsq(A / t[:, None], torch.ones_like(t)[:, None]).solution.view(-1)  # min sum ((A c - t) / t)^2
        assert ref[0] > 0 and ref[1] > 0
        assert fa == pytest.approx(float(ref[0]), rel=1e-6) and fb == pytest.approx(1 / float(ref[1]), rel=1e-6)
        plain = torch.linalg.lstsq(A, t[:, None]).solution.view(-1)  # the unweighted fit is another line
        assert abs(float(plain[0]) - fa) > 1e-3 * fa
        # the line through two points
        i, j = 2, 9
        ta, tb = a + float(sizes[i]) / b, a + float(sizes[j]) / b
        fa, fb = fit_latency_bandwidth([float(sizes[i]), float(sizes[j])], [ta, tb])
        assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)
        # flat timings (a power of two: the weighted mean is exact, the slope exactly 0)
        with pytest.raises(ValueError, match="do not grow"):
            fit_latency_bandwidth(sizes.tolist(), [2.0**-14] * 12)
    with pytest.raises(ValueError, match="two"):
        fit_latency_bandwidth([1.0, 2.0, 3.0], [1.0, 2.0])


def test_pipelined_pass_argument_limits_both_sides():
    """Zero compute is a pass of exchanges alone (2n back to back); a negative exchange or a
    negative compute time is refused on its own."""
    import torch

    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = float(torch.rand((), generator=gen, dtype=torch.float64))
        n = int(torch.randint(1, 6, (), generator=gen))
        assert pipelined_pass_time(x, 0.0, n) == pytest.approx(2 * n * x)
        with pytest.raises(ValueError, match="times >= 0"):
            pipelined_pass_time(x, -x - 1e-3, n)
        with pytest.raises(ValueError, match="times >= 0"):
            pipelined_pass_time(-x - 1e-3, x, n)


def test_predicted_step_counts_the_exchange_from_two_ranks():
    """Two ranks exchange: the step is the pipelined passes with the faster exchange's chunk
    time, more than the compute alone."""
    import torch

    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        links = _random_links(gen, node_size=int(torch.randint(1, 9, (), generator=gen)))
        S, f, b = (torch.rand(3, generator=gen, dtype=torch.float64) * torch.tensor([1e6, 1e-2, 1e-2])).tolist()
        n = int(torch.randint(1, 4, (), generator=gen))
        x = min(flat_time(2, S / n, links), two_level_time(2, S / n, links))
        got = predicted_step_time(2, S, f, b, n, links)
        assert got == pytest.approx(pipelined_pass_time(x, f, n) + pipelined_pass_time(x, b, n), rel=1e-12)
        assert got > f + b
