"""``moeflow train`` under torchrun (``moeflow.train.worker``, ``moeflow.parallel.launch.torchrun``): the
flags are refused alike on every rank before any work (rank 0 says why); two torchrun agents (two
"nodes" of 2 ranks on this machine, c10d rendezvous) train like one process, with the two-level
exchange (slow tier); and a rank killed with SIGKILL at a random moment (in a step or in a save) makes
torchrun restart the ranks, which continue the run from its latest complete checkpoint by
themselves and end bit for bit where an uninterrupted run ends (fp64); and the launcher of
``--nproc`` killed with SIGKILL takes its agent and ranks with it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from moeflow.checkpoint import latest_checkpoint
from moeflow.cli.main import main
from moeflow.parallel.launch.torchrun import free_port, torchrun_job
from moeflow.train import LMTrainConfig, build_from_checkpoint, train_lm

from helpers import TORCHRUN_ENV, rank_pids, spawn_ranks, torchrun_cmd

_JOB = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"}


# ----------------------------------------------------------------------------- checks, no training


@pytest.mark.unit
def test_torchrun_job_reads_torchruns_environment() -> None:
    assert torchrun_job({"RANK": "1", "WORLD_SIZE": "2"}) is None  # not started by torchrun
    job = torchrun_job({**_JOB, "RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (job.rank, job.world, job.local_rank, job.local_world, job.restart_count, job.spans_nodes) == (3, 4, 1, 2, 2, True)
    with pytest.raises(ValueError, match=r"lacks \['RANK', 'MASTER_PORT'\]"):
        torchrun_job({k: v for k, v in _JOB.items() if k not in ("RANK", "MASTER_PORT")})
    with pytest.raises(ValueError, match="WORLD_SIZE='four' in the environment is not an integer"):
        torchrun_job({**_JOB, "WORLD_SIZE": "four"})
    with pytest.raises(ValueError, match="inconsistent torchrun environment: RANK=4, WORLD_SIZE=4"):
        torchrun_job({**_JOB, "RANK": "4"})


def _train(tmp_path: Path, capsys, *flags: str) -> tuple[int, str]:
    try:
        code = main(["train", "--out", str(tmp_path / "run"), "--no-progress", "--no-plot", *flags])
    except SystemExit as done:  # argparse
        code = int(done.code)
    return code, capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "needle"), [
    (["--nproc", "2"], "already is rank 0 of a torchrun job of 4 ranks"),
    (["--max-restarts", "1"], "--nproc and --max-restarts start torchrun"),
    (["--stall-timeout", "0"], "stall_timeout_s must be > 0 seconds, got 0.0"),
    (["--collective-timeout", "-5"], "collective_timeout_s must be > 0 seconds, got -5.0"),
    (["--experts", "6"], "6 is not divisible by 4"),
    (["--batch-size", "6"], "grad_accum x ranks = 1 x 4"),
    (["--exchange", "nope"], "invalid choice: 'nope'"),
    (["--val-works", "nope"], "nope"),
])
def test_every_rank_refuses_bad_flags_and_rank_0_says_why(tmp_path, capsys, monkeypatch, flags, needle) -> None:
    """Under torchrun every rank checks the flags alike before any work (nothing is started,
    no directory made); rank 0 reports, the others exit with the same status quietly."""
    for rank in (0, 1, 3):
        for key, value in {**_JOB, "RANK": str(rank), "LOCAL_RANK": str(rank % 2)}.items():
            monkeypatch.setenv(key, value)
        code, err = _train(tmp_path, capsys, *flags)
        assert code == 2 and (needle in err if rank == 0 else err == ""), (rank, err)
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "needle"), [
    (["--exchange", "two-level"], "exchange='two-level' needs more than one rank"),
    (["--max-restarts", "2"], "--max-restarts applies with --nproc and must be >= 0, got 2"),
    (["--nproc", "2", "--max-restarts", "-1"], "got -1"),
    (["--nproc", "3", "--batch-size", "6"], "8 is not divisible by 3"),
])
def test_launch_flags_are_refused_before_torchrun_starts(tmp_path, capsys, flags, needle) -> None:
    code, err = _train(tmp_path, capsys, *flags)
    assert code == 2 and needle in err


# ----------------------------------------------------------------------------- two nodes


@pytest.mark.distributed
@pytest.mark.slow  # ~48 s of CPU on 2 cores (6 processes); the default tier has both halves (below)
def test_two_torchrun_nodes_train_like_one_process(tmp_path) -> None:
    """Two agents of a c10d rendezvous (``--nnodes 2``, 2 ranks each) run one 4-rank job; the
    ranks span two nodes, so the exchange is two-level; losses and final parameters equal one
    process on the same global batches (fp64, no balance loss: it is per rank). The default
    tier runs the same two-node job from the parallel guide (``tests/test_docs.py``: the
    two-level exchange chosen) and the same training on 4 gloo ranks as 2 nodes of 2 against one
    process (``tests/test_train_lm.py::test_expert_parallel_training_equals_one_process``)."""
    kw = dict(steps=3, batch_size=8, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=1, val_works=("sonnets",),
              load_balance_coef=0.0, dtype="float64", progress=False, plot=False)
    single = train_lm(LMTrainConfig(out_dir=tmp_path / "one", **kw))
    flags = ["--steps", "3", "--batch-size", "8", "--seq-len", "32", "--warmup", "1", "--eval-every", "0",
             "--eval-batches", "1", "--val-works", "sonnets", "--load-balance-coef", "0", "--dtype", "float64",
             "--no-progress", "--no-plot", "--sample-tokens", "0", "--out", str(tmp_path / "ep")]
    rdzv = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(torchrun_cmd("-m", "moeflow", "train", *flags, rdzv=rdzv, nnodes=2, node_rank=node), env=TORCHRUN_ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert sum("throughput:" in o for o in outputs) == 1  # rank 0 alone reports
    assert "on 4 rank(s) (two-level exchange)" in "".join(outputs)
    ep = json.loads((tmp_path / "ep" / "history.json").read_text())
    assert (ep["world_size"], ep["node_size"], ep["exchange"]) == (4, 2, "two-level")
    torch.testing.assert_close(torch.tensor(ep["train_loss"]), torch.tensor(single["train_loss"]), rtol=1e-10, atol=0)
    m1, _, _ = build_from_checkpoint(tmp_path / "one")
    m4, _, info = build_from_checkpoint(tmp_path / "ep")
    assert info["world_size"] == 4
    for (n, p), (_, q) in zip(m1.named_parameters(), m4.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-8, atol=1e-10, msg=n)


# ----------------------------------------------------------------------------- killed ranks


def _flags(out: Path, steps: int) -> list[str]:
    return ["--steps", str(steps), "--batch-size", "4", "--seq-len", "16", "--warmup", "1", "--eval-every", "0",
            "--eval-batches", "1", "--dtype", "float64", "--checkpoint-every", "1", "--no-progress", "--no-plot",
            "--sample-tokens", "0", "--out", str(out)]


def _case_uninterrupted(rank: int, world: int, out: str, steps: int) -> None:
    """``_flags``' run as ``train_lm`` itself on a rank of a gloo group (what each torchrun rank
    of ``moeflow train`` calls, with the same settings): the reference of the killed runs."""
    train_lm(LMTrainConfig(out_dir=Path(out), steps=steps, batch_size=4, seq_len=16, warmup_steps=1, eval_every=0,
                           eval_batches=1, dtype="float64", checkpoint_every=1, progress=False, plot=False))


CASES = {"uninterrupted": _case_uninterrupted}


def _wait(what: str, ready, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: the job ended (exit {proc.returncode}) or {timeout_s} s passed")
        time.sleep(0.005)


def _next_attempt_steps(proc: subprocess.Popen, out: Path, old: set[int]) -> tuple[dict[int, int], float, float]:
    """Wait until ranks other than the processes ``old`` run and have finished a step (rank 0
    rewrites history.json after each step, before its checkpoint); return their ``{rank: pid}``,
    when they were first seen and the time of that write."""
    seen: dict[str, object] = {}

    def ready() -> bool:
        if "pids" not in seen:
            pids = rank_pids(proc.pid)
            if len(pids) < 2 or set(pids.values()) & old:
                return False
            seen.update(pids=pids, since=time.time())  # within 5 ms of their start, seconds before a step
        written = (out / "history.json").stat().st_mtime if (out / "history.json").exists() else 0.0
        return written > seen["since"]  # type: ignore[operator]

    _wait("a step of the restarted ranks", ready, proc)
    return seen["pids"], seen["since"], (out / "history.json").stat().st_mtime  # type: ignore[return-value]


def _saving(ckpts: Path) -> bool:
    return ckpts.is_dir() and any(p.name.startswith(".tmp-step-") for p in ckpts.iterdir())


def _kill_ranks(proc: subprocess.Popen, out: Path, kinds: list[str], rng: random.Random) -> list[dict]:
    """SIGKILL a random rank of the job once per entry of ``kinds``, each time after the ranks
    (torchrun's restart of them) have finished a step: ``"save"`` while a checkpoint is being
    written, ``"step"`` as soon as one is complete (in the next step's forward and backward),
    ``"random"`` up to a second later. Returns per kill: kind, rank, whether a save was under
    way, the seconds from the kill to the restarted ranks running (``respawn_s``) and to the end
    of their first step (``recovery_s``)."""
    ckpts, trials, old = out / "checkpoints", [], set()
    pids, _, _ = _next_attempt_steps(proc, out, old)
    for kind in kinds:
        if kind == "save":
            _wait("a save", lambda: _saving(ckpts), proc)
        elif kind == "step":
            latest = latest_checkpoint(ckpts)
            _wait("a new checkpoint", lambda last=latest: latest_checkpoint(ckpts) not in (None, last), proc)
        else:
            time.sleep(rng.uniform(0.0, 1.0))
        rank = rng.choice(sorted(pids))
        in_save = _saving(ckpts)
        os.kill(pids[rank], signal.SIGKILL)
        killed_at, old = time.time(), old | set(pids.values())
        pids, running_at, stepped_at = _next_attempt_steps(proc, out, old)
        trials.append({"kind": kind, "rank": rank, "in_save": in_save, "respawn_s": running_at - killed_at,
                       "recovery_s": stepped_at - killed_at})
    return trials


def _killed_run_equals_uninterrupted(tmp_path: Path, kinds: list[str]) -> list[dict]:
    """An uninterrupted run on 2 gloo ranks (``_case_uninterrupted``: bit for bit a torchrun job
    of the same flags, without ~15 s of CPU for its three processes) and one through ``moeflow
    train --nproc 2 --max-restarts N`` whose ranks are killed at random moments: equal losses
    and parameters, bit for bit. Returns the kills (``_kill_ranks``)."""
    seed = zlib.crc32(",".join(kinds).encode())  # fixed per test, printed with every failure
    rng, steps = random.Random(seed), 3 * len(kinds) + 4  # a kill comes at most ~3 steps after a restart
    spawn_ranks(2, __name__, "uninterrupted", str(tmp_path / "ref"), steps)
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "moeflow", "train", "--nproc", "2", "--max-restarts",
                                 str(len(kinds)), *_flags(out, steps)], env=TORCHRUN_ENV, stdout=sink,
                                stderr=subprocess.STDOUT)
        try:
            trials = _kill_ranks(proc, out, kinds, rng)
            proc.wait(timeout=300)
        finally:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, f"seed {seed}: {trials}\n{text[-4000:]}"
    assert text.count("torchrun restarted the ranks: continuing the run") == len(kinds)
    ref, run = (json.loads((d / "history.json").read_text()) for d in (tmp_path / "ref", out))
    assert run["step"] == list(range(1, steps + 1)) and run["train_loss"] == ref["train_loss"], f"seed {seed}: {trials}"
    (m_ref, _, _), (m_run, _, _) = build_from_checkpoint(tmp_path / "ref"), build_from_checkpoint(out)
    for (n, p), (_, q) in zip(m_ref.named_parameters(), m_run.named_parameters()):
        assert torch.equal(p, q), f"seed {seed}: {n} differs after {trials}"
    print(f"seed {seed}; kills (kind, rank, in a save, s to restarted ranks, s to their first step): "
          f"{[(t['kind'], t['rank'], t['in_save'], round(t['respawn_s'], 2), round(t['recovery_s'], 2)) for t in trials]}")
    assert any(t["in_save"] for t in trials), f"seed {seed}: no kill landed in a save: {trials}"
    return trials


# ----------------------------------------------------------------------------- the launcher killed


def _started_at(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks after boot, /proc/PID/stat field 22), or None
    when it is gone or a zombie (it has exited, only its parent has not reaped it): with the
    pid, what tells a recorded process from a later one that got its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _process_tree(pid: int) -> dict[int, int]:
    """``{pid: start time}`` of process ``pid`` and all its descendants (from /proc)."""
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop()
        started = _started_at(p)
        if started is None:
            continue
        tree[p] = started
        try:
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
        except OSError:  # it exited meanwhile
            continue
    return tree


def _alive(tree: dict[int, int]) -> list[int]:
    return [p for p, started in tree.items() if _started_at(p) == started]


@pytest.mark.e2e
def test_killing_the_launcher_ends_every_process_of_the_job(tmp_path) -> None:
    """``moeflow train --nproc 2`` killed with SIGKILL once its ranks train: its agent and both
    ranks go too (they used to train on as orphans, writing checkpoints), within 30 s (about
    2 s measured on the 2-core VM: the agent's SIGTERM on its launcher's death, torchrun's
    shutdown of the ranks; the ranks' SIGKILL on the agent's death backs it up)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "moeflow", "train", "--nproc", "2", *_flags(out, 100_000)],
                            env=TORCHRUN_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree: dict[int, int] = {}
    try:
        _wait("the ranks' first step", lambda: (out / "history.json").exists(), proc)  # rank 0 writes it after a step
        tree = _process_tree(proc.pid)
        assert len(rank_pids(proc.pid)) == 2 and len(tree) >= 4, tree  # launcher, agent, 2 ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30.0
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(tree), f"still running after the launcher was killed: {_alive(tree)} of {tree}"
    finally:
        tree.update(_process_tree(proc.pid))  # (still the whole tree if a step above failed)
        proc.kill()
        proc.wait()
        for pid in _alive(tree):  # never leave a process behind, whatever failed above
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.e2e
def test_killed_ranks_restart_and_end_bit_for_bit(tmp_path) -> None:
    """One rank killed in a save, one at a random moment; torchrun restarts the ranks each time."""
    _killed_run_equals_uninterrupted(tmp_path, ["save", "random"])


@pytest.mark.e2e
@pytest.mark.slow  # ~2 min: ten restarts
def test_ten_kills_at_random_moments_end_bit_for_bit(tmp_path) -> None:
    trials = _killed_run_equals_uninterrupted(tmp_path, ["save", "step", "random"] * 3 + ["save"])
    assert len(trials) == 10 and max(t["recovery_s"] for t in trials) < 60
