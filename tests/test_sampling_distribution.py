"""The distribution tokens are drawn from (``moeflow.models.decoding.sample_next`` and the
generation loops that call it), held to the fp64 reference of ``tests/sampling_reference.py``
by goodness-of-fit tests at a stated false-failure rate.

The support tests of ``test_models_generation.py`` check *which* tokens may be drawn; these
check *how often*: a temperature applied twice or inverted, a top-k or a top-p cut off by one
token, top-p taken before top-k or before the temperature each change the distribution by far
more than ``N`` draws can hide (each was planted by hand: docs/testing.md lists what failed).
Every test has a fixed seed, so it is deterministic; its ``alpha`` is how likely a correct
sampler would fail it at a seed chosen at random. The logits of each designed row keep every
cut at least 0.02 (in probability) or 0.05 (in logits) from deciding otherwise, checked below,
so that float32 rounding can never move a boundary.

Legend: ``B`` rows, ``N`` draws a row, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeflow.models.decoding import SamplingConfig, sample_next
from moeflow.models.generation import generate, generate_uncached

from helpers import small_gpt
from sampling_reference import assert_draws_fit, assert_generation_fits, boundary_margin, reference_probs

pytestmark = pytest.mark.reference

V = 16
N = 20_000
ALPHA = 1e-6  # per row of a case; a case's rows together at most B * ALPHA (union bound)


def _row(sorted_probs: list[float], perm_seed: int) -> torch.Tensor:
    """Logits ``[V]`` whose softmax is ``sorted_probs`` with the tokens in a shuffled order (a
    sampler that forgets the sort shows), shifted by a constant (which softmax ignores)."""
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(perm_seed), device="cpu")
    probs = torch.tensor(sorted_probs, dtype=torch.float64, device="cpu")[perm.argsort()]
    assert abs(float(probs.sum()) - 1) < 1e-12
    return probs.log() + 3.0


# Designed rows: mass spread over many tokens at steps a cut off by one token moves by 0.05-0.16.
ROW_A = _row([0.30, 0.22, 0.16, 0.12, 0.08, 0.05, 0.03, 0.02] + [0.0025] * 8, perm_seed=1)
ROW_B = _row([0.18, 0.16, 0.14, 0.12, 0.10, 0.08, 0.07, 0.05, 0.04, 0.03, 0.02] + [0.002] * 5, perm_seed=2)

CASES = {  # id -> SamplingConfig fields
    "plain": dict(temperature=1.0),
    "cold": dict(temperature=0.6),
    "hot": dict(temperature=1.7),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.65),
    "temperature+top_k": dict(temperature=0.8, top_k=6),
    "temperature+top_p": dict(temperature=1.3, top_p=0.75),
    "top_k+top_p": dict(temperature=1.0, top_k=4, top_p=0.7),
    "all_three": dict(temperature=0.9, top_k=6, top_p=0.7),
    "top_k=1": dict(temperature=1.3, top_k=1),
}


def _rows(gen: torch.Generator, fields: dict) -> torch.Tensor:
    """``[B, V]``: the two designed rows and a fresh random one (its margin checked too)."""
    rows = torch.stack([ROW_A, ROW_B, torch.randn(V, generator=gen, dtype=torch.float64) * 1.5])
    for b, row in enumerate(rows):
        margin = boundary_margin(row, **fields)
        floor = 0.02 if b < 2 else 1e-4
        assert margin > floor, f"row {b} has a cut {margin:.3g} from deciding otherwise: draw other logits"
    return rows


def _draws(logits_BV: torch.Tensor, fields: dict, seed: int) -> torch.Tensor:
    """``[N, B]``: N draws of every row, in one call on ``N * B`` rows (row ``b`` repeated)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return sample_next(logits_BV.repeat(N, 1), SamplingConfig(**fields), g).view(N, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_reference_probabilities(gen, case: str, dtype: torch.dtype) -> None:
    """N = 20000 draws of each of 3 rows (two designed, one random) fit the reference
    probabilities: chi-square at alpha = 1e-6 a row (3e-6 a test, union bound); no token outside
    the support is ever drawn."""
    fields = CASES[case]
    logits_BV = _rows(gen, fields)
    draws_NB = _draws(logits_BV.to(dtype), fields, seed=11)
    assert draws_NB.dtype == torch.int64
    for b in range(logits_BV.shape[0]):
        assert_draws_fit(draws_NB[:, b], reference_probs(logits_BV[b], **fields), alpha=ALPHA, what=f"{case} row {b}")


def test_the_designed_rows_tell_each_planted_bug_from_the_rule() -> None:
    """What makes the cases above sharp: the designed rows' reference under each planted bug
    differs from the rule's by at least 0.04 in one token's probability (N = 20000 draws
    tell 0.01 apart at the alpha above), so none of them can pass by the rows' choice."""
    def ref(row, **f):  # type: ignore[no-untyped-def]
        return reference_probs(row, **{"temperature": 1.0, **f})

    for row in (ROW_A, ROW_B):
        planted = [
            (ref(row, top_k=5), ref(row, top_k=4)), (ref(row, top_k=5), ref(row, top_k=6)),
            (ref(row, top_p=0.65), ref(row, top_k=_n_top_p(row, 0.65) - 1)),
            (ref(row, top_p=0.65), ref(row, top_k=_n_top_p(row, 0.65) + 1)),
            (ref(row, temperature=0.6), ref(row, temperature=0.36)), (ref(row, temperature=0.6), ref(row, temperature=1 / 0.6)),
            (ref(row, temperature=1.7), ref(row, temperature=1.0)),
        ]
        for rule, bug in planted:
            assert float((rule - bug).abs().max()) >= 0.04


def _n_top_p(row: torch.Tensor, top_p: float) -> int:
    return int((reference_probs(row, temperature=1.0, top_p=top_p) > 0).sum())


def test_top_p_keeps_the_token_whose_mass_reaches_p_exactly() -> None:
    """Four tied tokens (top_k=4 leaves exactly 1/4 each, the sums exact in fp32): top_p = 0.5
    is reached by two of them, so exactly two are drawn, each half the time; a hair more than
    0.5 needs a third; 0.75 three, 0.76 all four (transformers' ``TopPLogitsWarper`` keeps the
    same sets). Chi-square at alpha = 1e-6 a row; which of the tied tokens stay is not part of
    the contract."""
    logits_BV = torch.tensor([[2.0, 0.5, 2.0, -1.0, 2.0, 2.0, 0.0, 1.0], [1.0, 3.0, -2.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    tied = [{0, 2, 4, 5}, {1, 3, 4, 6}]
    for top_p, kept in ((0.5, 2), (0.501, 3), (0.75, 3), (0.76, 4), (1e-3, 1)):
        draws_NB = _draws(logits_BV, dict(temperature=1.0, top_k=4, top_p=top_p), seed=5)
        for b in range(2):
            seen = sorted(set(draws_NB[:, b].tolist()))
            assert len(seen) == kept and set(seen) <= tied[b], (top_p, b, seen)
            probs = torch.zeros(8, dtype=torch.float64)
            probs[seen] = 1 / kept
            assert_draws_fit(draws_NB[:, b], probs, alpha=ALPHA, what=f"top_p={top_p} row {b}")


def test_the_sampler_is_handed_the_reference_probabilities(gen, monkeypatch) -> None:
    """The probabilities ``sample_next`` hands ``torch.multinomial``, both sides of every cut:
    inside the support each token keeps softmax(logits / T)'s share of the kept mass (the ratio
    of two kept tokens is exp of their tempered logit gap: nothing renormalised wrongly), outside
    it exactly 0. Computed in fp32 for bf16 and fp32 logits (1e-6), in fp64 for fp64 (1e-12)."""
    handed: list[torch.Tensor] = []
    multinomial = torch.multinomial

    def spy(probs, *args, **kwargs):  # type: ignore[no-untyped-def]
        handed.append(probs)
        return multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    for case, fields in CASES.items():
        logits_BV = _rows(gen, fields)
        for dtype, rtol in ((torch.bfloat16, 1e-6), (torch.float32, 1e-6), (torch.float64, 1e-12)):
            low = logits_BV.to(dtype)
            sample_next(low, SamplingConfig(**fields), torch.Generator().manual_seed(0))
            probs_BV = handed.pop()
            assert probs_BV.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), (case, dtype)
            for b in range(3):
                want = reference_probs(low[b].double(), **fields)
                got = probs_BV[b].double()
                assert torch.equal(got == 0, want == 0), (case, dtype, b, got, want)
                torch.testing.assert_close(got, want, rtol=rtol, atol=0, msg=f"{case} {dtype} row {b}")


def test_without_cuts_even_the_tiniest_probabilities_stay(monkeypatch) -> None:
    """``top_k=0`` and ``top_p=1`` cut nothing: with one token holding all but 2e-10 of the mass
    (its fp32 probability rounds to 1, so a top-p pass at p = 1 would see the mass before every
    other token already at 1 and drop them), every other token keeps its probability of about
    1.4e-11 in what ``torch.multinomial`` is handed."""
    handed: list[torch.Tensor] = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *a, **k: handed.append(probs) or multinomial(probs, *a, **k))
    logits_BV = torch.zeros(2, V)
    logits_BV[0, 3], logits_BV[1, 11] = 25.0, 25.0
    sample_next(logits_BV, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    probs_BV = handed.pop()
    assert float(probs_BV[0, 3]) == 1.0  # the rounding that would let a cut at p = 1 drop the rest
    for b in range(2):
        torch.testing.assert_close(probs_BV[b].double(), reference_probs(logits_BV[b], temperature=1.0), rtol=1e-6, atol=0)
        assert bool((probs_BV[b] > 0).all())


def test_the_draw_runs_where_draw_device_puts_it(monkeypatch) -> None:
    """``sample_next`` asks ``draw_device`` where to draw, with the caller's generator and the
    probabilities' device (it decides between drawing in place and a copy to the generator's
    device; on a machine without CUDA both are the CPU, so the question itself is checked)."""
    import moeflow.models.decoding as decoding

    asked: list[tuple] = []
    real = decoding.draw_device
    monkeypatch.setattr(decoding, "draw_device", lambda g, device: asked.append((g, device)) or real(g, device))
    for g in (torch.Generator().manual_seed(1), None):
        sample_next(ROW_A.float()[None], SamplingConfig(temperature=0.8, top_p=0.9), g)
        assert asked.pop() == (g, torch.device("cpu")) and not asked


@pytest.mark.parametrize(("fields", "error", "message"), [
    (dict(top_k=-1), ValueError, r"^top_k must be >= 0, got -1$"),
    (dict(top_k=True), TypeError, r"^top_k must be an int, got bool True$"),
    (dict(top_p=True), TypeError, r"^top_p must be a number, got bool True$"),
    (dict(top_p="high"), TypeError, r"^top_p must be a number, got str 'high'$"),
    (dict(temperature=True), TypeError, r"^temperature must be a number, got bool True$"),
])
def test_a_bad_sampling_setting_is_named_in_its_error(fields: dict, error: type, message: str) -> None:
    """The whole message names the field (not a word that contains it) and the value: a bool is
    no number here, though Python counts it as an int."""
    with pytest.raises(error, match=message):
        SamplingConfig(**fields)


# ----------------------------------------------------------------------------- generation loops

GEN_CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.2, top_p=0.8),
    "all_three": dict(temperature=0.8, top_k=6, top_p=0.85),
}


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    """A small MoE GPT over 16 tokens, weights drawn wide (std 0.3) so that its next-token
    distributions are far from uniform (a wrong temperature shows)."""
    torch.manual_seed(3)
    m = small_gpt(vocab_size=V, max_seq_len=32).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return m


@pytest.mark.parametrize("uncached", [False, True], ids=["generate", "generate_uncached"])
@pytest.mark.parametrize("case", list(GEN_CASES))
def test_generation_draws_each_token_from_the_reference(model, gen, case: str, uncached: bool) -> None:
    """64 prompts x 12 new tokens (768 draws, each from its own context's distribution) through
    the KV-cached loop and the uncached one: probability integral transforms uniform by
    chi-square at alpha = 1e-6 (10 bins)."""
    fields = GEN_CASES[case]
    prompts_BP = torch.randint(0, V, (64, 4), generator=gen)
    g = torch.Generator().manual_seed(17)
    if uncached:
        tokens = generate_uncached(model, prompts_BP, 12, generator=g, **fields)
    else:
        tokens = generate(model, prompts_BP, 12, generator=g, **fields).tokens
    assert assert_generation_fits(model, prompts_BP.tolist(), tokens, fields, seed=1, alpha=ALPHA) > 700


def test_alpha_is_the_stated_false_failure_rate() -> None:
    """The chi-square tail the tests use (``torch.special.gammaincc``) against known quantiles:
    chi2(1) exceeds 3.841 with probability 0.05 and 23.93 with 1e-6; chi2(9) 21.67 with 0.01."""
    from sampling_reference import chi2_sf

    for stat, dof, p in ((3.841459, 1, 0.05), (23.928127, 1, 1e-6), (21.665994, 9, 0.01), (9.0, 2, math.exp(-4.5))):
        assert chi2_sf(stat, dof) == pytest.approx(p, rel=1e-5)
