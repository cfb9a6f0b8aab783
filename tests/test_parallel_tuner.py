"""The auto-tuner (``moeflow.parallel.placement.tuner``): its decision rule on injected trial times (the MAX
over 2 gloo ranks counts), its configuration through ``ParallelConfig`` and the JSON round trip of
its choices; in one process (the reduction over ranks replaced by the identity, which is what it
is on one rank) its rule in detail, and ``run`` on calls timed by a fake clock. The tuner's
choices on real calls: ``test_parallel_dispatcher.py`` ("pipelined")."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

import moeflow
from moeflow.parallel import expert_parallel
from moeflow.parallel.placement import tuner as tuner_module
from moeflow.parallel.placement.tuner import ParallelTuner

from helpers import spawn_ranks

D = 8


def _case_tuner_ties(rank: int, world: int) -> None:
    """The tuner's decision rule on injected trial times (rank-dependent: the MAX over ranks
    counts): a candidate far behind stops being timed after its first trials, near ties (within
    ``close``) are timed on to ``max_trials`` each, and the median of those decides."""
    from moeflow.parallel.placement.tuner import ParallelTuner

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
    from moeflow.parallel.placement.tuner import ParallelTuner

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


@pytest.mark.distributed
def test_tuner_times_near_ties_on():
    spawn_ranks(2, __name__, "tuner_ties")


@pytest.mark.distributed
def test_tuner_decides_by_the_slowest_rank():
    spawn_ranks(2, __name__, "tuner_slowest_rank")


# ------------------------------------------------------------------------------------------
# one process: the reduction over ranks is the identity


@pytest.fixture
def one_rank(monkeypatch):
    """The tuner in one process: its MAX over ranks leaves the times as they are."""
    monkeypatch.setattr(tuner_module, "all_reduce_max", lambda t, group: t)


KEY = (8, 2, 1.0, "auto", "auto")


def _feed(tuner: ParallelTuner, setting, seconds: float, key=KEY) -> None:
    tuner._pending.append((key, setting, seconds, {}, 1.0))
    tuner._finish_trials(torch.device("cpu"))


@pytest.mark.unit
@pytest.mark.parametrize("mode,degree", [("expert", 2), ("data", 1), ("sharded", 1), ("hybrid:2", 1)])
def test_every_parallel_mode_round_trips_as_a_fixed_setting(mode, degree):
    """``fix`` takes a recorded choice of each mode (hybrid too) for a call with ``"auto"`` in
    either argument; a fixed choice survives ``reset`` and ``settings`` gives it back."""
    for parallel, overlap in (("auto", "auto"), ("auto", degree), (mode, "auto")):
        if parallel == mode and mode != "expert":
            continue  # only expert parallelism has overlap degrees to tune
        rec = {"tokens": 16, "top_k": 2, "capacity_factor": 1.25, "parallel": parallel, "overlap_degree": overlap,
               "choice": {"parallel": mode, "overlap_degree": degree}}
        tuner = ParallelTuner(None)
        assert tuner.config == moeflow.TunerConfig()  # the defaults without a config
        tuner.fix([rec])
        assert tuner.choices == {(16, 2, 1.25, parallel, overlap): (mode, degree)}
        tuner.reset()
        assert tuner.settings() == [rec]
    with pytest.raises(ValueError, match="parallel mode"):
        ParallelTuner(None).fix([{**rec, "choice": {"parallel": "hybrid:1", "overlap_degree": 1}}])
    # an empty batch is a call too; a bool is no capacity factor; a choice says exactly two things
    ParallelTuner(None).fix([{**rec, "tokens": 0}])
    for bad, needle in (({**rec, "capacity_factor": True}, "capacity_factor"),
                        ({**rec, "choice": {**rec["choice"], "why": "fast"}}, "exactly parallel and overlap_degree")):
        with pytest.raises(ValueError, match=needle):
            ParallelTuner(None).fix([bad])


@pytest.mark.unit
def test_reset_forgets_tuned_choices_and_trials_but_not_fixed_ones(one_rank):
    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=1, min_time_s=0.0))
    a, b = ("expert", 1), ("data", 1)
    other = (4, 1, 1.0, "auto", 1)
    tuner.fix([{"tokens": 4, "top_k": 1, "capacity_factor": 1.0, "parallel": "auto", "overlap_degree": 1,
                "choice": {"parallel": "data", "overlap_degree": 1}}])
    tuner._times[KEY] = {a: [], b: []}
    for seconds in (1.0, 1.0):
        _feed(tuner, a, seconds)
        _feed(tuner, b, 2 * seconds)
    assert tuner.choices == {other: b, KEY: a} and tuner._imbalance == {KEY: 1.0}
    tuner._times[(9, 1, 1.0, "auto", "auto")] = {a: [1.0]}
    tuner._open[(9, 1, 1.0, "auto", "auto")] = [a]
    tuner._pending.append((KEY, a, 1.0, {}, 1.0))
    tuner.reset()
    assert tuner.choices == {other: b}
    assert not tuner._times and not tuner._open and not tuner._pending and not tuner._imbalance


@pytest.mark.unit
def test_short_calls_are_timed_until_they_add_up_to_min_time(one_rank):
    """``trials`` timed calls are enough only when they add up to ``min_time_s``; else a
    candidate is timed on, up to ``max_trials``; the warm-up call never counts."""
    a, b = ("expert", 1), ("expert", 2)
    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=2, max_trials=5, close=0.1, min_time_s=1.0))
    tuner._times[KEY] = {a: [], b: []}
    for seconds in (9.0, 0.3, 0.3):  # warm-up (long: it must not count), then two short trials
        _feed(tuner, a, seconds)
        _feed(tuner, b, 2 * seconds)
    assert not tuner.choices  # a: 0.6 s of trials < min_time_s
    _feed(tuner, a, 0.3)
    _feed(tuner, b, 0.6)  # b has 1.8 s: enough; a 0.9 s
    assert not tuner.choices
    _feed(tuner, a, 0.3)  # a: 1.2 s in 4 trials
    assert tuner.choices == {KEY: a} and len(tuner._times[KEY][a]) == 5
    def race(config: moeflow.TunerConfig, trials: tuple[float, ...], slower: float) -> ParallelTuner:
        """``a`` timed at ``trials`` (warm-up first), ``b`` at ``slower`` times those, in turn."""
        tuner = ParallelTuner(None, config)
        tuner._times[KEY] = {a: [], b: []}
        for seconds in trials:
            _feed(tuner, a, seconds)
            _feed(tuner, b, slower * seconds)
        return tuner

    # trials adding up to exactly min_time_s are enough
    exact = race(moeflow.TunerConfig(trials=2, max_trials=5, close=0.1, min_time_s=1.0), (9.0, 0.5, 0.5), 4)
    assert exact.choices == {KEY: a}
    # at max_trials a candidate is done whatever its sum
    capped = race(moeflow.TunerConfig(trials=1, max_trials=2, close=0.1, min_time_s=100.0), (1.0, 1.0, 1.0), 3)
    assert capped.choices == {KEY: a}


@pytest.mark.unit
def test_equal_medians_prefer_expert_parallelism_then_the_lower_degree(one_rank):
    """A tie of medians (after the near-tie trials) goes to the expert mode, then to the lower
    overlap degree: the setting with the least to go wrong."""
    for candidates, best in (([("data", 1), ("expert", 2), ("expert", 1)], ("expert", 1)),
                             ([("data", 1), ("expert", 4)], ("expert", 4)),
                             ([("expert", 3), ("expert", 2)], ("expert", 2))):
        tuner = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=2, close=0.1, min_time_s=0.0))
        tuner._times[KEY] = {c: [] for c in candidates}
        for _ in range(3):
            for c in candidates:
                _feed(tuner, c, 1.0)
        assert tuner.choices == {KEY: best}, candidates


@pytest.mark.unit
def test_a_median_exactly_close_behind_is_a_near_tie(one_rank):
    """``close`` is inclusive: a median exactly ``1 + close`` times the best one's is timed on."""
    a, b = ("expert", 1), ("expert", 2)
    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=3, close=0.5, min_time_s=0.0))
    tuner._times[KEY] = {a: [], b: []}
    for _ in range(2):
        _feed(tuner, a, 1.0)
        _feed(tuner, b, 1.5)
    assert not tuner.choices and tuner._open[KEY] == [a, b]


@pytest.mark.unit
def test_a_trial_of_a_key_already_chosen_or_forgotten_is_dropped(one_rank):
    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=1, min_time_s=0.0))
    a = ("expert", 1)
    _feed(tuner, a, 1.0)  # no such key: nothing happens
    assert not tuner._times and not tuner.choices and not tuner._pending
    tuner._times[KEY] = {a: []}
    _feed(tuner, a, 1.0)
    _feed(tuner, a, 1.0)
    assert tuner.choices == {KEY: a} and tuner._times[KEY][a] == [1.0, 1.0]
    _feed(tuner, a, 5.0)  # chosen: later trials do not count
    assert tuner._times[KEY][a] == [1.0, 1.0]


class _Clock:
    """``time.perf_counter`` for the tuner: each candidate's run advances it by its cost."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def _call(ids_TK: torch.Tensor, E: int, *, requires_grad: bool = False):
    T, K = ids_TK.shape
    x_TD = torch.randn(T, 4, dtype=torch.float64, requires_grad=requires_grad)
    routing = SimpleNamespace(logits_TE=torch.zeros(T, E, dtype=torch.float64))
    group = SimpleNamespace(ids_TK=ids_TK, num_tokens=T, top_k=K, counts_E=torch.bincount(ids_TK.flatten(), minlength=E))
    return SimpleNamespace(x_TD=x_TD, routing=routing, group_routing=group, capacity_factor=1.0)


@pytest.mark.unit
def test_run_times_the_candidates_round_robin_then_keeps_the_fastest(one_rank, monkeypatch):
    """On calls: one candidate per call in candidate order (warm-up, then trials), each timed
    by its forward; once chosen every call runs the choice untimed; a routing whose imbalance
    moves past ``retune_ratio`` is tuned again, one that stays within it keeps the choice."""
    clock = _Clock()
    monkeypatch.setattr(tuner_module, "time", clock)
    cost = {("expert", 1): 2.0, ("expert", 2): 1.0, ("data", 1): 3.0}
    ran = []

    def run(setting, x_TD):
        ran.append(setting)
        clock.now += cost[setting]
        return x_TD * 2

    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=2, max_trials=4, close=0.1, min_time_s=0.0,
                                                    retune_ratio=1.5))
    even = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])  # every expert twice: imbalance 1
    call = _call(even, 4)
    key = (4, 2, 1.0, "auto", "auto")
    for _ in range(9):
        y = tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
        assert torch.equal(y, call.x_TD * 2)
    assert ran == list(cost) * 3  # warm-up + 2 trials each, round-robin
    # the last trial is reduced at the start of the next call (a point every rank reaches)
    assert tuner._times[key] == {c: [s] * (2 if c == ("data", 1) else 3) for c, s in cost.items()}
    assert len(tuner._pending) == 1 and not tuner.choices
    ran.clear()
    tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
    assert tuner.choices == {key: ("expert", 2)} and tuner._imbalance[key] == 1.0 and ran == [("expert", 2)]
    assert not tuner._pending  # the chosen setting is not timed
    # imbalance 1.33 (within 1.5 of 1): the choice stays
    mild = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]])
    tuner.run(_call(mild, 4), parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
    assert ran == [("expert", 2)] * 2 and tuner.choices == {key: ("expert", 2)}
    # every token on expert 0 and 1 of 4: imbalance 2, past 1.5: tuned again from the first candidate
    skewed = torch.tensor([[0, 1]] * 4)
    tuner.run(_call(skewed, 4), parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
    assert key not in tuner.choices and ran[-1] == ("expert", 1) and len(tuner._pending) == 1
    assert tuner._times[key] == {c: [] for c in cost}
    # a near tie: only the tied candidates are run on until each has max_trials
    ran.clear()
    cost.update({("expert", 1): 1.0, ("expert", 2): 1.05, ("data", 1): 3.0})
    tie = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=3, close=0.1, min_time_s=0.0))
    for _ in range(11):
        tie.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
    assert ran == list(cost) * 2 + [("expert", 1), ("expert", 2)] * 2 + [("expert", 1)]
    assert tie.choices == {key: ("expert", 1)}
    # a fixed choice runs without timing, whatever the imbalance
    fixed = ParallelTuner(None)
    fixed.fix([{"tokens": 4, "top_k": 2, "capacity_factor": 1.0, "parallel": "auto", "overlap_degree": "auto",
                "choice": {"parallel": "data", "overlap_degree": 1}}])
    fixed.run(_call(skewed, 4), parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
    assert ran[-1] == ("data", 1) and not fixed._pending and not fixed._times


@pytest.mark.unit
def test_a_trial_counts_the_layers_backward(one_rank, monkeypatch):
    """When the call is back-propagated, a trial's time is its forward plus this layer's
    backward (from the output's gradient arriving to the input's leaving), not the backward of
    what comes before or after it."""
    clock = _Clock()
    monkeypatch.setattr(tuner_module, "time", clock)

    class Slow(torch.autograd.Function):  # the layer: its backward takes 5 s on the clock
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x * 3

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            clock.now += 5.0
            return g * 3

    def run(setting, x_TD):
        clock.now += 1.0
        return Slow.apply(x_TD)

    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=1, min_time_s=0.0))
    call = _call(torch.tensor([[0, 1], [2, 3]]), 4, requires_grad=True)
    y = tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: [("expert", 1)], run=run)
    clock.now += 50.0  # time spent between forward and backward (the rest of the model)
    (y * 2).sum().backward()
    clock.now += 50.0
    assert torch.equal(call.x_TD.grad, torch.full_like(call.x_TD, 6.0))
    tuner._finish_trials(torch.device("cpu"))
    key = (2, 2, 1.0, "auto", "auto")
    assert tuner._times[key] == {("expert", 1): [6.0]}  # 1 s forward + 5 s backward
    # without grad: the forward alone, and no stamp nodes on the output
    call = _call(torch.tensor([[0, 1], [2, 3]]), 4)
    y = tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: [("expert", 1)], run=run)
    assert y.grad_fn is None or "Stamp" not in type(y.grad_fn).__name__
    tuner._finish_trials(torch.device("cpu"))
    assert tuner.choices == {key: ("expert", 1)} and tuner._times[key][("expert", 1)] == [6.0, 1.0]


@pytest.mark.unit
def test_run_logs_its_choices_and_retunes_and_counts_on_the_calls_device(one_rank, monkeypatch, caplog):
    """What a user reads on the ``moeflow.parallel`` logger: the choice with each candidate's
    median, and a retune with the imbalance before and after. The trial times are reduced in a
    tensor on the call's device (under NCCL a CPU tensor would crash the collective: here the
    default device is ``meta``, so a tensor that does not name its device fails). The imbalance
    of a batch with fewer assignments than experts is the busiest expert over the true mean."""
    clock = _Clock()
    monkeypatch.setattr(tuner_module, "time", clock)
    cost = {("expert", 1): 0.0021234, ("data", 1): 0.003}  # s: logged in ms to 3 decimals

    def run(setting, x_TD):
        clock.now += cost[setting]
        return x_TD

    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=1, min_time_s=0.0, retune_ratio=1.5))
    sparse = torch.tensor([[0, 1]])  # one token, two of eight experts: mean 0.25, busiest 1
    call, busier = _call(sparse, 8), _call(torch.tensor([[0, 0]]), 8)
    with caplog.at_level(logging.INFO, logger="moeflow.parallel"), torch.device("meta"):
        for _ in range(5):
            tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
        key = (1, 2, 1.0, "auto", "auto")
        assert tuner.choices == {key: ("expert", 1)} and tuner._imbalance[key] == 4.0
        tuner.run(busier, parallel="auto", overlap_degree="auto", candidates=lambda: list(cost),
                  run=run)  # busiest 2 over 0.25: 8, twice 4
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "moeflow tuner: chose parallel='expert' overlap_degree=1 for (1, 2, 1.0, 'auto', 'auto') "
        "(median ms: {'expert/1': 2.123, 'data/1': 3.0})",
        "moeflow tuner: routing imbalance moved 4.00 -> 8.00 for (1, 2, 1.0, 'auto', 'auto'); tuning again",
    ]


@pytest.mark.unit
def test_run_adds_no_autograd_node_without_grad_and_waits_for_a_cuda_call(one_rank, monkeypatch):
    """Without gradients the candidate gets the call's own input and the caller its output (no
    stamp nodes); a trial whose output is on a GPU is timed after ``torch.cuda.synchronize`` of
    that GPU (kernels run asynchronously: without it a trial would time the launch only)."""
    clock = _Clock()
    monkeypatch.setattr(tuner_module, "time", clock)
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    call = _call(torch.tensor([[0, 1], [2, 3]]), 4)
    outputs = []

    def run(setting, x_TD):
        assert x_TD is call.x_TD
        outputs.append(x_TD + 1)
        return outputs[-1]

    tuner = ParallelTuner(None, moeflow.TunerConfig(trials=1, max_trials=1, min_time_s=0.0))
    y = tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: [("expert", 1)], run=run)
    assert y is outputs[-1] and synced == []

    class OnGPU:  # what a candidate returns on cuda:1, as far as the tuner looks at it
        device, requires_grad = torch.device("cuda", 1), False

    gpu_y = OnGPU()
    assert tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: [("expert", 1)],
                     run=lambda setting, x_TD: gpu_y) is gpu_y
    assert synced == [torch.device("cuda", 1)]


@pytest.mark.unit
def test_pending_trials_are_reduced_together_over_the_tuners_own_group(monkeypatch):
    """Every pending trial is reduced in one collective over the tuner's group (an expert group
    smaller than the world reduces among its own ranks), a trial of a key already chosen or
    forgotten is skipped, and the ones after it still count."""
    group = object()
    reduced = []

    def all_reduce_max(t, g):
        reduced.append((t.tolist(), g))
        return t

    monkeypatch.setattr(tuner_module, "all_reduce_max", all_reduce_max)
    a, b = ("expert", 1), ("data", 1)
    tuner = ParallelTuner(group, moeflow.TunerConfig(trials=1, max_trials=2, close=0.1, min_time_s=0.0))
    done, tie, open_ = (2, 1, 1.0, "auto", "auto"), (4, 1, 1.0, "auto", "auto"), (3, 1, 1.0, "auto", "auto")
    tuner.choices[done], tuner._times[done] = a, {a: [1.0, 1.0]}
    tuner._times[tie] = {a: [1.0, 1.0], b: [1.0]}
    tuner._times[open_] = {a: [1.0], b: []}
    tuner._pending += [(done, a, 5.0, {}, 1.0), (("gone",), a, 6.0, {}, 1.0), (tie, b, 1.0, {}, 1.0),
                       (open_, b, 7.0, {}, 1.0), (open_, a, 2.0, {}, 1.0)]
    tuner._finish_trials(torch.device("cpu"))
    assert reduced == [([5.0, 6.0, 1.0, 7.0, 2.0], group)]
    assert tuner._times[done] == {a: [1.0, 1.0]} and tuner._times[open_] == {a: [1.0, 2.0], b: [7.0]}
    assert tuner._open == {tie: [a, b]} and set(tuner.choices) == {done}  # the tie is timed on
    assert not tuner._pending


@pytest.mark.unit
def test_an_overlap_degree_is_chosen_only_when_pipelining_pays(one_rank, monkeypatch):
    """The explicit rule (``TunerConfig.overlap_margin``): a degree above 1 is kept only when
    its median beats its mode's degree 1 by more than the margin (pipelining hides at most the
    exchange; where that is small the gain is noise): degree 1 otherwise, or another mode if
    that is faster than degree 1; a degree list without 1 has nothing to compare with."""
    clock = _Clock()
    monkeypatch.setattr(tuner_module, "time", clock)

    def choose(cost, margin=0.03):
        def run(setting, x_TD):
            clock.now += cost[setting]
            return x_TD

        tuner = ParallelTuner(None, moeflow.TunerConfig(degrees=tuple(d for m, d in cost if m == "expert"), trials=1,
                                                        max_trials=1, min_time_s=0.0, overlap_margin=margin))
        call = _call(torch.tensor([[0, 1], [2, 3]]), 4)
        while not tuner.choices:
            tuner.run(call, parallel="auto", overlap_degree="auto", candidates=lambda: list(cost), run=run)
        return next(iter(tuner.choices.values()))

    e1, e2, e4, data = ("expert", 1), ("expert", 2), ("expert", 4), ("data", 1)
    assert choose({e1: 1.0, e2: 0.98, e4: 0.99}) == e1  # 2% faster: within the margin
    assert choose({e1: 1.0, e2: 0.98, e4: 0.99}, margin=0.01) == e2  # a smaller margin lets it pay
    assert choose({e1: 1.0, e2: 0.96, e4: 0.90}) == e4  # 10% faster: pays
    assert choose({e1: 1.0, e2: 0.98, data: 0.99}) == data  # degree 2 does not count; data beats degree 1
    assert choose({e2: 0.98, e4: 0.99}) == e2  # no degree 1 among the candidates
