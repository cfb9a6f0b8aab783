"""The auto-tuner (``moeflow.parallel.tuner``): its decision rule on injected trial times (the MAX
over 2 gloo ranks counts), its configuration through ``ParallelConfig`` and the JSON round trip of
its choices. The tuner's choices on real calls: ``test_parallel_dispatcher.py`` ("pipelined")."""

from __future__ import annotations

import re

import pytest
import torch

import moeflow
from moeflow.parallel import expert_parallel

from helpers import spawn_ranks

pytestmark = pytest.mark.distributed

D = 8


def _case_tuner_ties(rank: int, world: int) -> None:
    """The tuner's decision rule on injected trial times (rank-dependent: the MAX over ranks
    counts): a candidate far behind stops being timed after its first trials, near ties (within
    ``close``) are timed on to ``max_trials`` each, and the median of those decides."""
    from moeflow.parallel.tuner import ParallelTuner

    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=3, max_trials=6, close=0.1, min_time_s=0.0))
    key = (8, 2, 1.0, "auto", "auto")
    a, b, c = ("expert", 1), ("expert", 2), ("data", 1)
    tuner._times[key] = {a: [], b: [], c: []}
    # b looks 5% faster than a on its first trials, then is 10% slower; c is 2x slower
    plan = {a: [1.0] * 7, b: [0.95] * 4 + [1.1] * 3, c: [2.0] * 4}
    fed = {a: 0, b: 0, c: 0}

    def feed(setting):  # one trial: rank 0 sees 1 ms less (the MAX over ranks must be used)
        seconds = plan[setting][fed[setting]] - 0.001 * (rank == 0)
        fed[setting] += 1
        tuner._pending.append((key, setting, seconds, {}, 1.0))
        tuner._finish_trials(torch.device("cpu"))

    for _ in range(4):  # warm-up + 3 trials each
        for setting in (a, b, c):
            feed(setting)
    assert not tuner.choices and tuner._open[key] == [a, b]  # b leads by 5%: a tie to settle
    for _ in range(3):
        feed(a)
        feed(b)
    assert tuner.choices == {key: a}  # medians over 6 trials: a 1.0, b 1.1 (ties only were timed)
    assert fed[c] == 4 and key not in tuner._open
    with pytest.raises(ValueError, match="close"):
        ParallelTuner(None, moeflow.TunerConfig(close=1.5))
    # a clear winner is decided after the first round (no race with itself)
    clear = ParallelTuner(None, moeflow.TunerConfig(trials=3, max_trials=6, close=0.1, min_time_s=0.0))
    clear._times[key] = {a: [], b: [], c: []}
    for seconds in (1.0, 1.0, 1.0, 1.0):
        for setting, scale in ((a, 1.0), (b, 2.0), (c, 3.0)):
            clear._pending.append((key, setting, seconds * scale, {}, 1.0))
            clear._finish_trials(torch.device("cpu"))
    assert clear.choices == {key: a}
    # ParallelConfig(tuner=...) sets the expert-parallel dispatcher's candidates and budget
    tuned = moeflow.TunerConfig(degrees=(1, 3), max_trials=5, close=0.2)
    config = moeflow.ParallelConfig(parallel="auto", overlap_degree="auto", tuner=tuned)
    ep = expert_parallel(moeflow.MoE(dim=D, hidden=8, num_experts=4, top_k=1, dtype=torch.float64), config=config)
    assert ep.dispatcher.parallel == config and ep.dispatcher.tuner.config == tuned
    assert [c for c in ep.dispatcher.candidates(ep.experts, "auto", "auto") if c[0] == "expert"] == [("expert", 1), ("expert", 3)]
    # the deprecated DispatchConfig fields still configure it, when expert_parallel gets no config
    with pytest.warns(DeprecationWarning):
        old = moeflow.DispatchConfig(parallel="auto", overlap_degree="auto", tuner=tuned)
    ep = expert_parallel(moeflow.MoE(dim=D, hidden=8, num_experts=4, top_k=1, dispatch=old, dtype=torch.float64))
    assert ep.dispatcher.parallel == config
    # the choices round-trip through JSON into a fresh tuner, which keeps them across reset()
    import json

    again = ParallelTuner(None)
    again.fix(json.loads(json.dumps(tuner.settings())))
    again.reset()
    assert again.choices == tuner.choices
    good = tuner.settings()[0]
    for bad, needle in (({**good, "choice": {"parallel": "data", "overlap_degree": 2}}, "overlap degree"),
                        ({**good, "choice": {"parallel": "model", "overlap_degree": 1}}, "'model'"),
                        ({**good, "tokens": -1}, "tokens"), ({k: v for k, v in good.items() if k != "top_k"}, "exactly"),
                        ({**good, "capacity_factor": "1"}, "capacity_factor"),
                        ({**good, "capacity_factor": float("nan")}, "finite"),
                        ({**good, "parallel": ["auto"]}, "arguments"), ({**good, "parallel": "bogus"}, "arguments"),
                        ({**good, "overlap_degree": 2.7}, "arguments"), ({**good, "overlap_degree": True}, "arguments"),
                        ({**good, "parallel": "expert", "overlap_degree": 1}, "is not tuned"),
                        ({**good, "parallel": "expert", "choice": {"parallel": "data", "overlap_degree": 1}},
                         "not a candidate")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            ParallelTuner(None).fix([bad])


def _case_tuner_uses_the_slowest_rank(rank: int, world: int) -> None:
    """Each rank sees the other setting as the slow one: ``a`` is fast on rank 0 and slow on
    rank 1, ``b`` the other way round but less so. The slowest rank sets a step's pace, so the
    MAX over ranks decides (``b``: 1.3 against ``a``'s 1.5); a MIN (1.0 against 1.2) or a
    rank's own times would pick ``a``, and on one rank only, so the ranks would disagree."""
    from moeflow.parallel.tuner import ParallelTuner

    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=3, max_trials=3, close=0.05, min_time_s=0.0))
    key = (8, 2, 1.0, "auto", "auto")
    a, b = ("expert", 1), ("expert", 2)
    tuner._times[key] = {a: [], b: []}
    seconds = {a: (1.0, 1.5), b: (1.3, 1.2)}  # (rank 0, rank 1)
    for _ in range(4):  # warm-up + 3 trials each
        for setting in (a, b):
            tuner._pending.append((key, setting, seconds[setting][rank], {}, 1.0))
            tuner._finish_trials(torch.device("cpu"))
    assert tuner._times[key] == {a: [1.5] * 4, b: [1.3] * 4}, tuner._times[key]
    assert tuner.choices == {key: b}


CASES = {  # looked up by the spawned ranks
    "tuner_ties": _case_tuner_ties,
    "tuner_slowest_rank": _case_tuner_uses_the_slowest_rank,
}


def test_tuner_times_near_ties_on():
    spawn_ranks(2, __name__, "tuner_ties")


def test_tuner_decides_by_the_slowest_rank():
    spawn_ranks(2, __name__, "tuner_slowest_rank")
