"""The all-to-all cost model (``moeflow.parallel.placement.costmodel``, pure arithmetic)."""

from __future__ import annotations

import pytest

from moeflow.parallel.placement.costmodel import LinkModel, crossover, fit_latency_bandwidth, flat_time, two_level_time

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
