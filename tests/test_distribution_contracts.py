"""Contracts that are distributions, other than sampling (``test_sampling_distribution.py``):
the router's noise and input jitter (``RouterConfig.noise_std``, ``jitter_eps``) and the data
sampler's mixture of sources and window starts (``moeflow.train.tokens.TokenSampler``), each
held to its law by a goodness-of-fit test at a stated false-failure rate (``alpha``: how likely
a correct implementation would fail at a seed chosen at random; with the fixed seeds here each
test is deterministic). The chi-square tail is ``tests/sampling_reference.py``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeflow import RouterConfig
from moeflow.layer.router import Router
from moeflow.train.tokens import TokenDataset, TokenSampler, TokenStream

from sampling_reference import assert_draws_fit, assert_uniform

pytestmark = pytest.mark.reference

ALPHA = 1e-6


def _router(**cfg: object) -> Router:
    """A training router over D = 1 with weights (1, 2) and no bias: ``logits[t] = x'[t] * (1, 2)``
    shows what the router did to its input ``x'``; fp64."""
    router = Router(dim=1, num_experts=2, config=RouterConfig(bias=False, **cfg)).double().train()  # type: ignore[arg-type]
    with torch.no_grad():
        router.linear.weight.copy_(torch.tensor([[1.0], [2.0]], dtype=torch.float64))
    return router


@pytest.mark.parametrize("noise_std", [0.3, 1.7])
def test_router_noise_is_normal_with_the_configured_std(noise_std: float) -> None:
    """``logits - clean logits`` over 8192 tokens x 2 experts (16384 values) is N(0, noise_std^2):
    its transform by the normal CDF is uniform (chi-square over 20 bins, alpha = 1e-6), which a
    wrong std (10% off), a mean shift of 0.05 std or a uniform noise would each fail; one draw per
    logit (the two experts of a token differ). Without training the logits are the clean ones."""
    torch.manual_seed(7)
    router = _router(noise_std=noise_std)
    x_T1 = torch.randn(8192, 1, dtype=torch.float64)
    noise_TE = router(x_T1, top_k=1).logits_TE - router.logits(x_T1)
    assert not torch.equal(noise_TE[:, 0], noise_TE[:, 1] / 2)
    assert_uniform(torch.special.ndtr(noise_TE.flatten() / noise_std), bins=20, alpha=ALPHA, what="router noise")
    router.eval()
    assert torch.equal(router(x_T1, top_k=1).logits_TE, router.logits(x_T1))


def test_planted_noise_errors_fail_the_noise_test() -> None:
    """The test above is sharp: a std 10% off, a mean of 0.05 std and uniform noise of the same
    std each fail it (on the same number of draws)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(16384, generator=g, dtype=torch.float64)
    wrong = {"std 10% off": z * 1.1, "mean 0.05": z + 0.05,
             "uniform": (torch.rand(16384, generator=g, dtype=torch.float64) - 0.5) * 12**0.5}
    for what, values in wrong.items():
        with pytest.raises(AssertionError, match="chi-square"):
            assert_uniform(torch.special.ndtr(values), bins=20, alpha=ALPHA, what=what)


@pytest.mark.parametrize("eps", [0.05, 0.5])
def test_router_jitter_is_uniform_on_its_range(eps: float) -> None:
    """Input jitter multiplies each token's input by one factor drawn from U(1 - eps, 1 + eps):
    both sides of the range (never outside it, and every part of it as often as its width
    says: chi-square over 20 bins at alpha = 1e-6 on 16384 tokens); the two experts' logits of a
    token share the factor."""
    torch.manual_seed(3)
    router = _router(jitter_eps=eps)
    logits_TE = router(torch.ones(16384, 1, dtype=torch.float64), top_k=1).logits_TE
    u_T = logits_TE[:, 0]
    torch.testing.assert_close(logits_TE[:, 1], 2 * u_T, rtol=1e-15, atol=0)
    assert bool(((u_T >= 1 - eps) & (u_T <= 1 + eps)).all()), (u_T.min(), u_T.max())
    assert_uniform((u_T - (1 - eps)) / (2 * eps), bins=20, alpha=ALPHA, what=f"jitter eps={eps}")


def _sources(spans: list[int], seq_len: int) -> list[TokenDataset]:
    """In-memory token datasets whose windows of ``seq_len`` (``seq_len + 1`` tokens, the inputs
    and their next tokens) have ``spans[i]`` possible starts: ``spans[i] + seq_len`` tokens;
    token ``j`` of source ``i`` is ``1000 * i + j``, so a window tells where it came from."""
    return [TokenDataset.in_memory(np.arange(span + seq_len) + 1000 * i, {}, eod=None, name=f"source{i}")
            for i, span in enumerate(spans)]


def test_the_sampler_mixes_sources_by_their_weights_and_starts_uniformly() -> None:
    """``TokenSampler``'s global batches over 400 steps x 32 rows (12800 windows): the source of
    a window follows the weights (5:3:1, chi-square at alpha = 1e-6), and within each source the
    start is uniform over its possible starts, every one of them (the first and the last
    included) and none past the end (chi-square over the exact starts, alpha = 1e-6 a source);
    each window read is that stretch of its source. A weight ignored, the sources' order swapped
    or a span one too short or too long each fail (the spans of 3, 8 and 40 starts make one
    start 1/3 to 1/40 of a source's draws)."""
    seq_len, spans, weights = 6, [40, 8, 3], [5.0, 3.0, 1.0]
    sets = _sources(spans, seq_len)
    sampler = TokenSampler(sets, weights, seq_len=seq_len, seed=9)
    picks = [sampler.starts(step, 32) for step in range(400)]
    source_N = torch.cat([s for s, _ in picks])
    start_N = torch.cat([t for _, t in picks])
    mix = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    assert_draws_fit(source_N, mix, alpha=ALPHA, what="sources")
    for i, span in enumerate(spans):
        starts = start_N[source_N == i]
        assert_draws_fit(starts, torch.full((span,), 1 / span, dtype=torch.float64), alpha=ALPHA, what=f"source {i}")
    x, y = sampler.batch(3, 32)
    source, start = sampler.starts(3, 32)
    expected = 1000 * source[:, None] + start[:, None] + torch.arange(seq_len + 1)
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])


def test_one_source_starts_uniformly_over_every_window() -> None:
    """One token sequence (``TokenStream``, the built-in corpus' sampler): the starts of 200 steps x
    16 rows are uniform over all 13 possible windows of ``seq_len + 1`` tokens in 18, the last one
    (which reads the last token) included (chi-square at alpha = 1e-6)."""
    seq_len = 5
    stream = TokenStream(torch.arange(seq_len + 1 + 12), seq_len=seq_len, seed=4)
    starts = torch.cat([stream.starts(step, 16)[1] for step in range(200)])
    assert_draws_fit(starts, torch.full((13,), 1 / 13, dtype=torch.float64), alpha=ALPHA, what="one source")
