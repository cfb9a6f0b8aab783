"""Expert-parallel benchmark: ``moeflow bench --nproc N``.

One command measures, one after the other on the same machine:

1. the single-process layer with all E experts on one rank's batch (``tokens`` tokens,
   ``threads`` threads): the baseline a rank would run alone;
2. N ranks launched by torchrun (gloo on CPU, NCCL on GPU), each with ``tokens`` tokens,
   ``threads`` threads and E/N experts, exchanging tokens with all-to-all.

Reported: per-rank step time (forward+backward, median over repeats; the group's step is the
slowest rank's), the share of the step spent inside the exchanges (forward and backward), and
tokens/s of the whole group next to the baseline: ``scaling = group tokens/s / baseline``
(ideal: N).

``sweep=True`` (``--sweep``) also times every setting in ``SWEEP_SETTINGS`` (parallel mode and
pipelining degree) on the ranks, interleaved repeat by repeat so that machine noise hits them
alike, then lets a fresh layer with ``parallel="auto", overlap_degree="auto"`` tune itself on
its first calls and times its choice in the same rounds.

``skew > 0`` (``--skew 0.5``) forces routing where that share of the tokens picks expert 0
first, and times the layer with contiguous experts against a copy moved to the load-aware
placement (``moeflow.parallel.plan_placement``, ``expert_slots`` experts per rank; replicas need
more than E/N), interleaved; it reports the busiest rank's received rows and the step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moeflow.bench.layer import LayerBenchFlags, _machine, activation_is_gated
from moeflow.bench.memory import keep_freed_heap
from moeflow.config import ExpertsConfig, MoEConfig
from moeflow.layer.moe import MoE
from moeflow.parallel.launch.torchrun import run_torchrun

__all__ = ["ParallelBenchConfig", "run_parallel_bench", "format_parallel_table"]


@dataclass(frozen=True, kw_only=True)
class ParallelBenchConfig(LayerBenchFlags):
    nproc: int = 2
    threads: int = 1
    warmup: int = 2
    node_size: int | None = None
    sweep: bool = False
    skew: float = 0.0
    expert_slots: int = 0
    hidden_shards: int = 1

    _positive = ("nproc", *LayerBenchFlags._positive)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.hidden_shards, int) or self.hidden_shards < 1 or self.hidden % self.hidden_shards:
            raise ValueError(f"--hidden-shards must be a positive divisor of --hidden={self.hidden}, got {self.hidden_shards!r}")
        if (self.experts * self.hidden_shards) % self.nproc:
            raise ValueError(f"--experts={self.experts} x --hidden-shards={self.hidden_shards} must be divisible by "
                             f"--nproc={self.nproc}")
        if self.hidden_shards > 1 and (self.skew or self.expert_slots):
            raise ValueError("--skew/--expert-slots compare placements of whole experts; use --hidden-shards 1")
        if self.node_size is not None and (self.node_size < 1 or self.nproc % self.node_size):
            raise ValueError(f"--node-size must divide --nproc={self.nproc}, got {self.node_size}")
        if not 0.0 <= self.skew < 1.0:
            raise ValueError(f"--skew must lie in [0, 1), got {self.skew}")
        e = self.experts // self.nproc
        if self.expert_slots and not e <= self.expert_slots <= self.experts:
            raise ValueError(f"--expert-slots must lie in [E/nproc, E] = [{e}, {self.experts}], got {self.expert_slots}")


def _timed_steps(cfg: ParallelBenchConfig, layer: MoE, x: torch.Tensor, g: torch.Tensor, *, before_step=None, timer=None):  # type: ignore[no-untyped-def]
    """Forward+backward ``warmup + repeats`` times; the timed step seconds (and exchange
    seconds when a ``timer`` is attached). ``before_step`` runs untimed before each step."""
    steps, comms = [], []
    for rep in range(cfg.warmup + cfg.repeats):
        if before_step is not None:
            before_step()
        if timer is not None:
            timer.reset()
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(layer, x, g)
        if x.is_cuda:
            torch.cuda.synchronize()
        if rep >= cfg.warmup:
            steps.append(time.perf_counter() - t0)
            comms.append(timer.seconds if timer is not None else 0.0)
    return steps, comms


def _layer(cfg: ParallelBenchConfig, device: torch.device) -> MoE:
    torch.manual_seed(cfg.seed)
    return MoE(
        config=MoEConfig(
            dim=cfg.dim, hidden=cfg.hidden, num_experts=cfg.experts, top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor, experts=ExpertsConfig(activation=cfg.activation),
        ),
        device=device,
        dtype=cfg.torch_dtype,
    ).train()


def _batch(cfg: ParallelBenchConfig, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + rank)
    x = torch.randn(cfg.tokens, cfg.dim, generator=gen)
    g = torch.randn(cfg.tokens, cfg.dim, generator=gen)
    return x.to(device, cfg.torch_dtype), g.to(device, cfg.torch_dtype)


def _step(layer: MoE, x: torch.Tensor, g: torch.Tensor, setting: tuple | None = None) -> None:
    layer.zero_grad(set_to_none=True)
    kw = {} if setting is None else {"parallel": setting[0], "overlap_degree": setting[1]}
    layer(x.detach().requires_grad_(True), **kw).backward(g)


SWEEP_SETTINGS = (("expert", 1), ("expert", 2), ("expert", 4), ("expert", 8), ("data", 1), ("sharded", 1))
AUTO = ("auto", "auto")


def _label(setting: tuple) -> str:
    return f"{setting[0]}/{setting[1]}"


def _sweep(cfg: ParallelBenchConfig, layer: MoE, tuned: MoE, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward+backward seconds per degree (interleaved) on ``layer``, and the choice of a fresh
    expert-parallel copy ``tuned`` that runs ``overlap_degree="auto"``, with its times."""
    from moeflow.parallel.comm import barrier

    sliceable = cfg.hidden_shards == 1
    settings = [*(st for st in SWEEP_SETTINGS if st[0] != "sharded" or (cfg.hidden % cfg.nproc == 0 and sliceable)),
                *((f"hybrid:{r}", 1) for r in range(2, cfg.nproc + 1)
                  if sliceable and cfg.nproc % r == 0 and cfg.hidden % r == 0),
                AUTO]
    times: dict[str, list[float]] = {_label(s): [] for s in settings}
    calls = 0
    while not tuned.dispatcher.tuner.choices:  # let "auto" tune itself on its first calls
        _step(tuned, x, g, AUTO)
        calls += 1
    for rep in range(cfg.warmup + cfg.repeats):
        for setting in settings:
            barrier()
            t0 = time.perf_counter()
            _step(tuned if setting == AUTO else layer, x, g, setting)
            if rep >= cfg.warmup:
                times[_label(setting)].append(time.perf_counter() - t0)
    (choice,) = tuned.dispatcher.tuner.choices.values()
    return {"times_s": times, "auto_choice": _label(choice), "tuning_calls": calls}


def _skewed_ids(cfg: ParallelBenchConfig, rank: int) -> torch.Tensor:
    """``ids_TK`` where a ``skew`` share of the tokens choose expert 0 first and the rest of the
    choices are uniform (distinct per token): a synthetic hot expert."""
    gen = torch.Generator().manual_seed(cfg.seed + 2000 + rank)
    scores = torch.rand(cfg.tokens, cfg.experts, generator=gen)
    hot = torch.rand(cfg.tokens, generator=gen) < cfg.skew
    scores[hot, 0] = 2.0
    scores[~hot, 0] = -1.0  # a token that is not hot does not pick expert 0 at all
    return scores.topk(cfg.top_k, dim=1).indices


def _placement_compare(cfg: ParallelBenchConfig, layer: MoE, x: torch.Tensor, g: torch.Tensor, rank: int) -> dict:
    """Under skewed routing: the busiest rank's rows and the step time of ``layer`` as built
    (contiguous experts) and of a copy under ``plan_placement`` of the measured load with
    ``expert_slots`` slots (interleaved, slowest rank per repeat taken by the caller)."""
    import moeflow
    from moeflow.parallel import apply_placement, expert_parallel, plan_placement
    from moeflow.parallel.comm import all_reduce_sum, barrier

    ids = _skewed_ids(cfg, rank)
    tape = moeflow.RoutingTape({"": [ids]})
    load_E = all_reduce_sum(torch.bincount(ids.view(-1), minlength=cfg.experts).double(), None)
    slots = cfg.expert_slots or cfg.experts // cfg.nproc
    placed = expert_parallel(_layer(cfg, x.device))  # the same weights (seeded), moved below
    plan = plan_placement(load_E, world=cfg.nproc, slots_per_rank=slots)
    apply_placement(placed, [plan])

    def rows(m: MoE) -> int:
        """Rows this rank's experts receive in one call (from the group's slot assignment)."""
        from moeflow.parallel.exchange.assignment import assign_group

        routing = m.router(x, top_k=cfg.top_k, forced_ids_TK=ids)
        gathered = m.dispatcher.gather_routing(routing, capacity_factor=cfg.capacity_factor)
        group = assign_group(gathered, num_experts=cfg.experts, capacity_factor=cfg.capacity_factor,
                             drop_policy=m.dispatcher.config.drop_policy, placement=m.dispatcher.placement)
        return sum(row[rank] for row in group.counts_WW)

    runs = [("contiguous", layer, None), ("placed", placed, None)]
    if cfg.hidden % cfg.nproc == 0:  # the sharded-expert mode balances the work without replicas
        runs.append(("sharded", layer, ("sharded", 1)))
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for rep in range(cfg.warmup + cfg.repeats):
        for name, m, setting in runs:
            barrier()
            t0 = time.perf_counter()
            tape.rewind()
            with moeflow.replay_routing(m, tape):
                _step(m, x, g, setting)
            if rep >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    return {"times_s": times, "rows": {"contiguous": rows(layer), "placed": rows(placed)},
            "slots": [list(r) for r in plan.slots], "load": load_E.tolist()}


def _baseline(cfg: ParallelBenchConfig) -> list[float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(cfg.threads)
    layer = _layer(cfg, device)
    x, g = _batch(cfg, 0, device)
    return _timed_steps(cfg, layer, x, g)[0]


def _worker(cfg: ParallelBenchConfig, out_dir: Path) -> None:
    """Runs on every torchrun rank."""
    from moeflow.parallel import expert_parallel, init_distributed, make_groups, shutdown_distributed
    from moeflow.parallel.comm import CommTimer, barrier, group_rank

    init_distributed()
    rank = group_rank(None)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(cfg.threads)
    keep_freed_heap()
    groups = make_groups(cfg.nproc, node_size=cfg.node_size)
    layer = expert_parallel(_layer(cfg, device), groups.expert, hierarchy=groups.hierarchy,
                            hidden_shards=cfg.hidden_shards)
    timer = CommTimer()
    layer.dispatcher.exchange.timer = timer  # type: ignore[attr-defined]
    x, g = _batch(cfg, rank, device)
    steps, comms = _timed_steps(cfg, layer, x, g, before_step=barrier, timer=timer)
    layer.dispatcher.exchange.timer = None  # type: ignore[attr-defined]
    sweep = None
    if cfg.sweep:
        tuned = expert_parallel(_layer(cfg, device), groups.expert, hierarchy=groups.hierarchy,
                                hidden_shards=cfg.hidden_shards)
        sweep = _sweep(cfg, layer, tuned, x, g)
    placement = _placement_compare(cfg, layer, x, g, rank) if cfg.skew > 0 else None
    barrier()
    (out_dir / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "step_s": steps, "exchange_s": comms, "sweep": sweep, "placement": placement})
    )
    shutdown_distributed()  # leave together: a process group torn down at interpreter exit can abort


def run_parallel_bench(cfg: ParallelBenchConfig) -> dict:
    """Baseline in this process, then ``cfg.nproc`` ranks under torchrun; a JSON-able report."""
    keep_freed_heap()
    baseline = _baseline(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        run_torchrun("moeflow.bench.parallel", ["--worker", json.dumps(asdict(cfg)), tmp], nproc=cfg.nproc, threads=cfg.threads)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(cfg.nproc)]
    group_steps = [max(rk["step_s"][i] for rk in ranks) for i in range(cfg.repeats)]
    base_med = statistics.median(baseline)
    group_med = statistics.median(group_steps)
    F = (2 if activation_is_gated(cfg.activation) else 1) * cfg.hidden
    flops = 3.0 * 2.0 * cfg.tokens * cfg.top_k * cfg.dim * (F + cfg.hidden)
    sweep = None
    if cfg.sweep:
        names = list(ranks[0]["sweep"]["times_s"])
        auto, base = _label(AUTO), _label(SWEEP_SETTINGS[0])
        per = {n: [max(rk["sweep"]["times_s"][n][i] for rk in ranks) for i in range(cfg.repeats)] for n in names}
        med = {n: statistics.median(v) * 1e3 for n, v in per.items()}
        best = min((n for n in names if n != auto), key=lambda n: med[n])
        sweep = {"step_ms": med, "best": best, "auto_choice": ranks[0]["sweep"]["auto_choice"],
                 "auto_choices_agree": len({rk["sweep"]["auto_choice"] for rk in ranks}) == 1,
                 "tuning_calls": ranks[0]["sweep"]["tuning_calls"],
                 "auto_vs_best": med[auto] / med[best], "best_vs_baseline": med[best] / med[base]}
    placement = None
    if cfg.skew > 0:
        per = {n: [max(rk["placement"]["times_s"][n][i] for rk in ranks) for i in range(cfg.repeats)]
               for n in ranks[0]["placement"]["times_s"]}
        med = {n: statistics.median(v) * 1e3 for n, v in per.items()}
        busiest = {n: max(rk["placement"]["rows"][n] for rk in ranks) for n in ("contiguous", "placed")}
        placement = {"step_ms": med, "busiest_rows": busiest, "slots": ranks[0]["placement"]["slots"],
                     "load": ranks[0]["placement"]["load"],
                     "rows_reduction": 1 - busiest["placed"] / busiest["contiguous"],
                     "speedup": med["contiguous"] / med["placed"]}
    return {
        "sweep": sweep,
        "placement": placement,
        "benchmark": "expert_parallel",
        "config": asdict(cfg),
        "machine": {**_machine_info(), "backend": "nccl" if torch.cuda.is_available() else "gloo"},
        "baseline": {
            "step_ms": base_med * 1e3,
            "tokens_per_s": cfg.tokens / base_med,
            "tflops": flops / base_med / 1e12,
            "times_ms": [t * 1e3 for t in baseline],
        },
        "ranks": [
            {
                "rank": rk["rank"],
                "step_ms": statistics.median(rk["step_s"]) * 1e3,
                "exchange_ms": statistics.median(rk["exchange_s"]) * 1e3,
                "exchange_share": statistics.median(c / s for c, s in zip(rk["exchange_s"], rk["step_s"])),
            }
            for rk in ranks
        ],
        "group": {
            "step_ms": group_med * 1e3,
            "tokens_per_s": cfg.nproc * cfg.tokens / group_med,
            "scaling": (cfg.nproc * cfg.tokens / group_med) / (cfg.tokens / base_med),
            "efficiency": (cfg.tokens / group_med) / (cfg.tokens / base_med),
        },
    }


def _machine_info() -> dict:
    from moeflow.bench.layer import BenchConfig

    return _machine(BenchConfig(device="cuda" if torch.cuda.is_available() else "cpu"))


def format_parallel_table(report: dict) -> str:
    c, b, grp = report["config"], report["baseline"], report["group"]
    exchange = "two-level" if c["node_size"] else "flat"
    lines = [
        f"Expert parallel  ranks={c['nproc']} ({report['machine']['backend']}, {exchange} exchange"
        f"{', hidden_shards=' + str(c['hidden_shards']) if c.get('hidden_shards', 1) > 1 else ''}) "
        f"T={c['tokens']}/rank D={c['dim']} H={c['hidden']} E={c['experts']} K={c['top_k']} "
        f"cf={c['capacity_factor']} dtype={c['dtype']} threads/rank={c['threads']} repeats={c['repeats']}",
        f"machine: {report['machine']['cpu']}, torch {report['machine']['torch']}, {report['machine']['date']}",
        "",
        f"{'':<26}{'step ms':>10}{'exchange ms':>13}{'exchange %':>12}{'tokens/s':>12}",
        f"{'1 rank, all experts':<26}{b['step_ms']:>10.1f}{'-':>13}{'-':>12}{b['tokens_per_s']:>12.0f}",
    ]
    for rk in report["ranks"]:
        lines.append(
            f"{'rank ' + str(rk['rank']):<26}{rk['step_ms']:>10.1f}{rk['exchange_ms']:>13.1f}"
            f"{100 * rk['exchange_share']:>11.1f}%{'':>12}"
        )
    lines.append(f"{'group (slowest rank)':<26}{grp['step_ms']:>10.1f}{'':>13}{'':>12}{grp['tokens_per_s']:>12.0f}")
    lines.append("")
    lines.append(
        f"scaling: {grp['scaling']:.2f}x the single rank (ideal {c['nproc']}x), "
        f"efficiency {100 * grp['efficiency']:.0f}%"
    )
    sw = report.get("sweep")
    if sw:
        base = _label(SWEEP_SETTINGS[0])
        lines += ["", "parallel mode / overlap degree sweep (forward+backward, slowest rank, median; interleaved):",
                  f"{'parallel/overlap_degree':<26}{'step ms':>10}{'vs ' + base:>15}"]
        for name, ms in sw["step_ms"].items():
            label = f"auto (chose {sw['auto_choice']})" if name == _label(AUTO) else name
            mark = "  <- fastest" if name == sw["best"] else ""
            lines.append(f"{label:<26}{ms:>10.1f}{ms / sw['step_ms'][base]:>14.3f}x{mark}")
        lines.append(
            f"tuner: chose {sw['auto_choice']} after {sw['tuning_calls']} calls (all ranks agree: "
            f"{sw['auto_choices_agree']}); its time is {sw['auto_vs_best']:.3f}x the fastest setting's; "
            f"the fastest setting is {sw['best_vs_baseline']:.3f}x {base}"
        )
    pl = report.get("placement")
    if pl:
        total = sum(pl["load"])
        lines += ["", f"skewed routing (skew={c['skew']}: expert 0 gets {pl['load'][0] / total:.0%} of the assignments); "
                  f"load-aware placement with {len(pl['slots'][0])} slots/rank {pl['slots']}:",
                  f"{'':<26}{'busiest rank rows':>18}{'step ms':>10}",
                  f"{'contiguous experts':<26}{pl['busiest_rows']['contiguous']:>18}{pl['step_ms']['contiguous']:>10.1f}",
                  f"{'placed (replicas)':<26}{pl['busiest_rows']['placed']:>18}{pl['step_ms']['placed']:>10.1f}",
                  *([f"{'sharded-expert mode':<26}{'1/N of all':>18}{pl['step_ms']['sharded']:>10.1f}"]
                    if "sharded" in pl["step_ms"] else []),
                  f"busiest rank's rows {100 * pl['rows_reduction']:.0f}% lower; step {pl['speedup']:.2f}x faster "
                  "(forward+backward, slowest rank, median; interleaved)"]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("out_dir", type=Path)
    a = parser.parse_args()
    _worker(ParallelBenchConfig(**json.loads(a.worker)), a.out_dir)
