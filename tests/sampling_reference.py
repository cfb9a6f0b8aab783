"""The readable reference of how a token is sampled (``moeflow.models.decoding.sample_next``) and
the goodness-of-fit checks that hold draws to it (``tests/test_sampling_distribution.py``,
``tests/test_models_generation_compiled.py``).

The rule (``SamplingConfig``'s docstring; the same as transformers' ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper`` applied in that order): divide the logits by the
temperature; keep the ``top_k`` largest (and any tied with the k-th); of those, keep the
smallest set of the most likely tokens whose probability reaches ``top_p`` (the token that
crosses ``top_p`` is kept, one whose more likely tokens already hold ``top_p`` is not; the most
likely token always stays); renormalise. Written here in float64 over Python lists, one rule a
line, so that it reads as the contract and shares no code with the library.

A goodness-of-fit test gives the probability that draws of a correct sampler fail it (the
false-failure rate ``alpha``); with a fixed seed a test is deterministic, and ``alpha`` says how
likely a correct sampler would fail it at a seed chosen at random. The chi-square tail is
``torch.special.gammaincc`` (``chi2.sf(x, k) = Q(k/2, x/2)``), so no scipy is needed.
"""

from __future__ import annotations

import math

import torch

__all__ = ["reference_probs", "boundary_margin", "chi2_sf", "assert_draws_fit", "pit_values", "assert_uniform",
           "assert_generation_fits"]


def _kept(z: list[float], top_k: int, top_p: float) -> tuple[list[int], float]:
    """The tokens kept (in order of decreasing probability, ties by id) and the smallest distance
    of a cut from deciding otherwise (in logits for top-k, in probability for top-p; inf with
    no cut)."""
    V = len(z)
    order = sorted(range(V), key=lambda i: (-z[i], i))
    margin = math.inf
    if 0 < top_k < V:
        kth = z[order[top_k - 1]]
        order = [i for i in order if z[i] >= kth]  # ties with the k-th stay
        margin = kth - max((z[i] for i in range(V) if z[i] < kth), default=-math.inf)
    if top_p < 1:
        top = max(z[i] for i in order)
        weight = [math.exp(z[i] - top) for i in order]
        probs = [w / sum(weight) for w in weight]
        kept, before = [], 0.0
        for i, p in zip(order, probs):
            if kept and before >= top_p:  # the more likely tokens already hold top_p
                margin = min(margin, before - top_p)
                break
            if kept:
                margin = min(margin, top_p - before)
            kept.append(i)
            before += p
        order = kept
    return order, margin


def reference_probs(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The probability ``[V]`` (float64) with which each token of ``logits [V]`` is drawn."""
    z = [float(v) / temperature for v in logits.double().tolist()]
    kept, _ = _kept(z, top_k, top_p)
    top = max(z[i] for i in kept)
    weight = {i: math.exp(z[i] - top) for i in kept}
    total = sum(weight.values())
    return torch.tensor([weight.get(i, 0.0) / total for i in range(len(z))], dtype=torch.float64, device="cpu")


def boundary_margin(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> float:
    """How far ``logits [V]`` are from a top-k or top-p cut that would decide otherwise: the
    gap between the k-th and the next tempered logit, and the distance of each cumulative
    probability the top-p rule compares from ``top_p`` (the smaller; inf without cuts). Draws
    from logits computed in another order (a compiled step) can differ in support only below
    the rounding of those logits."""
    return _kept([float(v) / temperature for v in logits.double().tolist()], top_k, top_p)[1]


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square with ``dof`` degrees of freedom."""
    half = torch.tensor([dof / 2, stat / 2], dtype=torch.float64, device="cpu")
    return float(torch.special.gammaincc(half[0], half[1]))


def _chi_square(counts: list[int], expected: list[float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, with the categories expected fewer than 5
    times pooled (the chi-square approximation needs about 5 a category)."""
    pairs = sorted(zip(expected, counts))
    pooled: list[list[float]] = []
    for e, c in pairs:
        if pooled and pooled[-1][0] < 5:
            pooled[-1][0] += e
            pooled[-1][1] += c
        else:
            pooled.append([e, c])
    if len(pooled) > 1 and pooled[-1][0] < 5:  # a small last bin joins the one before it
        e, c = pooled.pop()
        pooled[-1][0] += e
        pooled[-1][1] += c
    stat = sum((c - e) ** 2 / e for e, c in pooled)
    return stat, len(pooled) - 1


def assert_draws_fit(draws_N: torch.Tensor, probs_V: torch.Tensor, *, alpha: float, what: str = "") -> None:
    """Draws ``[N]`` of one distribution ``probs_V`` (the reference): no token outside its
    support, and Pearson's chi-square test passes at level ``alpha`` (a correct sampler fails
    with probability ``alpha``)."""
    V, N = probs_V.numel(), draws_N.numel()
    counts = torch.bincount(draws_N.reshape(-1).cpu(), minlength=V).tolist()
    assert len(counts) == V, f"{what}: a token id past the vocabulary of {V}: {counts}"
    probs = probs_V.tolist()
    outside = {i: c for i, c in enumerate(counts) if probs[i] == 0 and c > 0}
    assert not outside, f"{what}: drew tokens outside the support {{id: count}} {outside}"
    support = [i for i in range(V) if probs[i] > 0]
    if len(support) == 1:
        return
    stat, dof = _chi_square([counts[i] for i in support], [N * probs[i] for i in support])
    pvalue = chi2_sf(stat, dof) if dof > 0 else 1.0
    assert pvalue > alpha, (f"{what}: chi-square {stat:.1f} on {dof} degrees of freedom, p = {pvalue:.3g} <= {alpha}; "
                            f"counts {[counts[i] for i in support]}, expected "
                            f"{[round(N * probs[i], 1) for i in support]} (tokens {support})")


def pit_values(draws_N: torch.Tensor, probs_NV: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The randomised probability integral transform of draws ``[N]``, each from its own
    distribution (a row of ``probs_NV``, tokens ordered by decreasing probability, ties by id):
    ``u = P(more likely tokens) + U * p(draw)`` with ``U ~ U(0, 1)`` from ``gen``. If every draw
    comes from its row (given the draws before it), the ``u`` are independent and uniform on
    [0, 1]; a sampler too cold puts them near 0, one too hot near 1. A draw outside its row's
    support fails here."""
    N, V = probs_NV.shape
    order_NV = torch.stack([torch.tensor(sorted(range(V), key=lambda i: (-p[i], i)), device="cpu")
                            for p in probs_NV.tolist()])
    sorted_NV = probs_NV.gather(1, order_NV)
    rank_N = (order_NV == draws_N.reshape(N, 1)).int().argmax(1)
    p_N = sorted_NV.gather(1, rank_N[:, None])[:, 0]
    bad = (p_N == 0).nonzero().flatten().tolist()
    assert not bad, f"draws {bad[:5]} are tokens outside their distribution's support"
    before_N = (sorted_NV.cumsum(1) - sorted_NV).gather(1, rank_N[:, None])[:, 0]
    return before_N + torch.rand(N, generator=gen, dtype=torch.float64, device="cpu") * p_N


def assert_uniform(u_N: torch.Tensor, *, bins: int, alpha: float, what: str = "") -> None:
    """``u [N]`` in [0, 1] pass Pearson's chi-square test of uniformity over ``bins`` equal bins
    at level ``alpha``."""
    N = u_N.numel()
    assert bool(((u_N >= 0) & (u_N <= 1)).all()), f"{what}: values outside [0, 1]"
    counts = torch.bincount((u_N * bins).long().clamp(max=bins - 1), minlength=bins).tolist()
    stat, dof = _chi_square(counts, [N / bins] * bins)
    pvalue = chi2_sf(stat, dof)
    assert pvalue > alpha, f"{what}: chi-square {stat:.1f} on {dof} degrees of freedom, p = {pvalue:.3g}; counts {counts}"


def assert_generation_fits(model, prompts: list[list[int]], tokens: list[list[int]], fields: dict, seed: int,  # type: ignore[no-untyped-def]
                           *, alpha: float, bins: int = 10) -> int:
    """The new ``tokens`` of each prompt (a generation without stop tokens) against the
    reference: each draw's distribution is ``reference_probs`` (``fields``: the sampling) of the
    model's whole-sequence forward (``model(idx)``, the uncached reference) at the position
    before it, and the randomised probability integral transforms of all draws must be uniform
    (chi-square over ``bins`` bins at ``alpha``). A step whose logits sit within 1e-4 of a cut
    is left out: the loops compute their logits in another order, and which steps are left out
    depends on the history only, so the rest stay independent and uniform. Returns the number
    of draws tested."""
    by_length: dict[int, list[int]] = {}
    for b, (p, t) in enumerate(zip(prompts, tokens)):
        by_length.setdefault(len(p) + len(t), []).append(b)
    probs, draws = [], []
    for rows in by_length.values():  # rows of one length run as one batch, without padding
        seq_BS = torch.tensor([prompts[b] + tokens[b] for b in rows], dtype=torch.long, device="cpu")
        with torch.no_grad():
            logits_BSV = model(seq_BS[:, :-1]).double()
        for i, b in enumerate(rows):
            for s in range(len(prompts[b]) - 1, seq_BS.shape[1] - 1):
                if boundary_margin(logits_BSV[i, s], **fields) > 1e-4:
                    probs.append(reference_probs(logits_BSV[i, s], **fields))
                    draws.append(int(seq_BS[i, s + 1]))
    u = pit_values(torch.tensor(draws, device="cpu"), torch.stack(probs), torch.Generator(device="cpu").manual_seed(seed))
    assert_uniform(u, bins=bins, alpha=alpha, what=str(fields))
    return len(draws)
