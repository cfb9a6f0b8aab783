"""Checkpoints (``moeflow.checkpoint``): in one process, the round trip, corruption, crashes,
resharding and the ``convert`` CLI; on gloo ranks, a checkpoint saved on 4 ranks resumes on 2, 1
and 4 with the same parameters, optimizer state and continued losses (fp64, dropless routing so
that splitting the batch over ranks does not change the math), hidden-sharded experts load into
any layout, and (slow) torchrun restarts a job whose rank was killed from its last checkpoint.
Mixtral conversion: ``test_convert_mixtral.py``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import moeflow
from moeflow.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    partial_checkpoints,
    read_index,
    reshard_checkpoint,
    save_checkpoint,
)
from moeflow.checkpoint.io import _write_tensors
from moeflow.cli.main import main
from moeflow.parallel import all_reduce_gradients, dense_parameters, expert_parallel

from helpers import spawn_ranks

ROOT = Path(__file__).resolve().parents[1]


def _model(E: int = 4, seed: int = 0, router: moeflow.RouterConfig | None = None) -> torch.nn.Module:
    """Linear(8, 8) then a dropless top-2 MoE (dim = hidden = 8) in fp64, built after seeding the
    global RNG with ``seed``. The default router moves its expert bias (a buffer to save); the
    multi-rank tests pass one without balance loss."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8, dtype=torch.float64),
        moeflow.MoE(dim=8, hidden=8, num_experts=E, top_k=2, capacity_factor=0, dtype=torch.float64,
                    router=moeflow.RouterConfig(bias_update_rate=1e-3) if router is None else router),
    )


def _trained(steps: int = 3, E: int = 4):
    model = _model(E)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(12, 8, generator=gen, dtype=torch.float64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        moeflow.update_expert_bias(model)
    return model, opt


def _tensors(path: Path, rng: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` by key (without the RNG states: ``rng=False``)."""
    out = {}
    for entry in read_index(path)["files"]:
        with safe_open(str(path / entry["file"]), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if rng or not k.startswith("rng/")})
    return out


@pytest.mark.reference
def test_round_trip_is_exact(tmp_path):
    model, opt = _trained()
    torch.manual_seed(123)
    path = save_checkpoint(tmp_path, 3, model, opt, extra={"data_position": 36})
    expected_rng = torch.get_rng_state()
    fresh = _model(seed=9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    torch.manual_seed(0)
    info = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert info["step"] == 3 and info["extra"] == {"data_position": 36} and info["path"] == str(path)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert opt.state[p].keys() == fresh_opt.state[q].keys()
        for k in opt.state[p]:
            assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), k
    # training continues identically
    x = torch.randn(12, 8, dtype=torch.float64)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).square().sum().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


@pytest.mark.reference
def test_keep_last_n_and_latest(tmp_path):
    model, opt = _trained(1)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    assert latest_checkpoint(tmp_path).name == "step-00000004"
    with pytest.raises(CheckpointError, match="step-00000004 already exists"):  # refused before writing anything
        save_checkpoint(tmp_path, 4, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]


def _corrupt_case(tmp_path: Path, how: str) -> Path:
    model, opt = _trained(1)
    path = save_checkpoint(tmp_path, 1, model, opt)
    file = path / read_index(path)["files"][0]["file"]
    if how == "flip":
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
    elif how == "truncate":
        file.write_bytes(file.read_bytes()[:-100])
    elif how == "delete":
        file.unlink()
    return path


@pytest.mark.reference
@pytest.mark.parametrize("how,match", [("flip", "sha256"), ("truncate", "truncated"), ("delete", "missing")])
def test_damaged_files_are_named(tmp_path, how, match):
    path = _corrupt_case(tmp_path, how)
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(path, _model())
    assert "rank00000-of-00001.safetensors" in str(err.value)


@pytest.mark.reference
def test_removed_expert_is_named(tmp_path):
    model, opt = _trained(1)
    path = save_checkpoint(tmp_path, 1, model, opt)
    index = read_index(path)
    entry = index["files"][0]
    tensors = _tensors(path)
    del tensors["param/1.experts.w_in@2"]
    index["files"][0] = _write_tensors(path / entry["file"], tensors)  # a consistent but incomplete checkpoint
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"expert\(s\) \[2\] of 1.experts.w_in \(E=\d+\) are in none of its files"):
        load_checkpoint(path, _model())


@pytest.mark.reference
def test_other_expert_count_or_shape_is_named(tmp_path):
    model, opt = _trained(1)
    path = save_checkpoint(tmp_path, 1, model, opt)
    with pytest.raises(CheckpointError, match="saved with 4 experts, the model has 8"):
        load_checkpoint(path, _model(E=8))
    other = torch.nn.Sequential(
        torch.nn.Linear(8, 8, dtype=torch.float64),
        moeflow.MoE(dim=8, hidden=16, num_experts=4, top_k=2, dtype=torch.float64),
    )
    with pytest.raises(CheckpointError, match=r"shape .* the model expects"):
        load_checkpoint(path, other)
    with pytest.raises(CheckpointError, match="dtype"):
        load_checkpoint(path, _model().float())
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nothing", _model())


_CRASH = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from test_checkpoint import _trained
    import moeflow.checkpoint.io as io
    from moeflow.checkpoint import save_checkpoint
    model, opt = _trained(1)
    save_checkpoint({root!r}, 1, model, opt)
    if {where!r} == "mid-file":
        real = io.save_file
        def half(tensors, path):
            real(tensors, path)
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        io.save_file = half
    else:  # killed before the rename, or between the rename and the index
        setattr(io, "_finalize" if {where!r} == "before-rename" else "_write_index", lambda *a: os.kill(os.getpid(), 9))
    save_checkpoint({root!r}, 2, model, opt)
    """
)


@pytest.mark.reference
@pytest.mark.parametrize("where", ["mid-file", "before-rename", "after-rename"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, where):
    script = _CRASH.format(tests=str(ROOT / "tests"), root=str(tmp_path), where=where)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr  # killed by SIGKILL
    left = "step-00000002" if where == "after-rename" else ".tmp-step-00000002"  # after: renamed, no index.json
    (tmp_path / ".tmp-step-00000007").mkdir()  # and the remains of another step's save
    assert [p.name for p in partial_checkpoints(tmp_path)] == sorted([left, ".tmp-step-00000007"])
    assert load_checkpoint(tmp_path, _model(), None)["step"] == 1  # the latest complete; checksums verified
    # the leftovers never block a save: the next one (of step 2 again) removes them all
    save_checkpoint(tmp_path, 2, *_trained(1))
    assert partial_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path).name == "step-00000002"


@pytest.mark.reference
def test_reshard_round_trip_is_exact(tmp_path):
    model, opt = _trained(2, E=8)
    src = save_checkpoint(tmp_path / "w1", 2, model, opt)
    four = reshard_checkpoint(src, tmp_path / "w4", 4)
    assert len(read_index(four)["files"]) == 4
    one = reshard_checkpoint(four, tmp_path / "w1b", 1)
    four_again = reshard_checkpoint(one, tmp_path / "w4b", 4)
    a, b = _tensors(src), _tensors(four_again)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # expert g of 8 lives in rank file g // 2 of a 4-rank layout
    index = read_index(four)
    assert "param/1.experts.w_in@5" in index["files"][2]["tensors"]
    with pytest.raises(ValueError, match="does not divide"):
        reshard_checkpoint(src, tmp_path / "w3", 3)


@pytest.mark.reference
def test_convert_cli(tmp_path, capsys):
    model, opt = _trained(1)
    save_checkpoint(tmp_path / "ck", 1, model, opt, extra={"epoch": 0})
    assert main(["convert", str(tmp_path / "ck"), "--info"]) == 0
    out = capsys.readouterr().out
    assert "1.experts.w_in: float64 (8, 16) x 4 experts" in out and "step 1" in out
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "w2"), "--world-size", "2"]) == 0
    assert len(read_index(latest_checkpoint(tmp_path / "w2"))["files"]) == 2
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "w3"), "--world-size", "3"]) == 2
    assert main(["convert", str(tmp_path / "missing"), "--info"]) == 2


@pytest.mark.reference
def test_index_is_plain_json_and_files_are_safetensors(tmp_path):
    model, opt = _trained(1)
    path = save_checkpoint(tmp_path, 1, model, opt)
    assert sorted(os.listdir(path)) == ["index.json", "rank00000-of-00001.safetensors"]
    index = json.loads((path / "index.json").read_text())
    assert index["experts"] == {"1.experts.w_in": 4, "1.experts.w_out": 4}


# ----------------------------------------------------------------------------- on gloo ranks

D, E, T_GLOBAL, STEPS = 8, 8, 24, 3


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(T_GLOBAL, D, generator=gen, dtype=torch.float64), torch.randn(T_GLOBAL, D, generator=gen, dtype=torch.float64)


def _setup(rank: int, world: int, shards: int = 1):
    model = _model(E, router=moeflow.RouterConfig(load_balance_coef=0.0))
    if world > 1:
        expert_parallel(model, hidden_shards=shards)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model, opt, rank: int, world: int, steps: range) -> list[float]:
    """Each step: this rank's slice of the global batch; sum loss; dense grads summed over ranks."""
    losses = []
    per = T_GLOBAL // world
    for step in steps:
        x, t = _batch(step)
        sl = slice(rank * per, (rank + 1) * per)
        loss = (model(x[sl]) - t[sl]).square().sum()
        loss.backward()
        if world > 1:
            all_reduce_gradients(dense_parameters(model), None, average=False)
            total = loss.detach().clone()
            dist.all_reduce(total)
        else:
            total = loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses


def _case_save_then_continue(rank: int, world: int, root: str, shards: int = 1, ck: str = "ck") -> None:
    model, opt = _setup(rank, world, shards)
    _train(model, opt, rank, world, range(STEPS))
    save_checkpoint(Path(root) / ck, STEPS, model, opt, extra={"next_step": STEPS})
    losses = _train(model, opt, rank, world, range(STEPS, 2 * STEPS))
    if rank == 0:
        (Path(root) / f"losses_{ck}_w{world}.json").write_text(json.dumps(losses))


def _case_resume(rank: int, world: int, root: str, src: str, tag: str, shards: int = 1) -> None:
    model, opt = _setup(rank, world, shards)
    info = load_checkpoint(Path(root) / src, model, opt)
    assert info["extra"] == {"next_step": STEPS} and info["world_size"] in (1, 2, 4)
    if world == 1 and tag in ("w1", "sliced_w1"):
        save_checkpoint(Path(root) / f"resaved_{tag}", STEPS, model, opt, extra=info["extra"])
    losses = _train(model, opt, rank, world, range(STEPS, 2 * STEPS))
    if rank == 0:
        (Path(root) / f"losses_{tag}.json").write_text(json.dumps(losses))


def _case_sliced_state_differs(rank: int, world: int, root: str) -> None:
    """Saving hidden-sharded experts joins slices collectively: optimizer state that differs
    between ranks must raise on every rank, not leave them waiting on each other."""
    model, opt = _setup(rank, world, 2)
    _train(model, opt, rank, world, range(1))
    if rank == 1:
        del opt.state[model[1].experts.w_in]
    with pytest.raises(ValueError, match="differs between ranks"):
        save_checkpoint(Path(root) / "bad", 1, model, opt)


CASES = {"save": _case_save_then_continue, "resume": _case_resume, "sliced_state_differs": _case_sliced_state_differs}


def _assert_same_bits(a: Path, b: Path) -> None:
    """The two checkpoint roots hold the same tensors, bit for bit."""
    first, second = _tensors(next(a.iterdir()), rng=False), _tensors(next(b.iterdir()), rng=False)
    assert first.keys() == second.keys()
    for k in first:
        assert torch.equal(first[k], second[k]), k


def _assert_losses(tmp_path: Path, tags: tuple[str, ...], reference: list[float]) -> None:
    """Each run ``tag`` continued with the reference run's losses."""
    for tag in tags:
        losses = json.loads((tmp_path / f"losses_{tag}.json").read_text())
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-10, atol=1e-10,
                                   msg=lambda m, tag=tag: f"{tag}: {m}")


@pytest.mark.distributed
def test_save_on_4_resume_on_2_1_4(tmp_path):
    spawn_ranks(4, __name__, "save", str(tmp_path))
    reference = json.loads((tmp_path / "losses_ck_w4.json").read_text())
    spawn_ranks(2, __name__, "resume", str(tmp_path), "ck", "w2")
    _case_resume(0, 1, str(tmp_path), "ck", "w1")  # one process, no torch.distributed
    spawn_ranks(4, __name__, "resume", str(tmp_path), "resaved_w1", "w4_from_w1")
    # parameters and optimizer state survive 4 -> 1 bit for bit
    _assert_same_bits(tmp_path / "ck", tmp_path / "resaved_w1")
    # continuing from the checkpoint gives the uninterrupted run's losses on any world size
    _assert_losses(tmp_path, ("w2", "w1", "w4_from_w1"), reference)


@pytest.mark.distributed
def test_hidden_sharded_checkpoint_loads_into_any_layout(tmp_path):
    """Experts split by hidden units over the ranks (``hidden_shards=2``, every expert on two
    ranks) are saved as whole experts: the checkpoint matches the unsplit run's, and resumes
    bit for bit in one process, on 2 ranks with whole experts and on 2 ranks split again."""
    spawn_ranks(4, __name__, "save", str(tmp_path))  # whole experts, the reference
    spawn_ranks(4, __name__, "save", str(tmp_path), 2, "sliced")
    whole = _tensors(next((tmp_path / "ck").iterdir()), rng=False)
    sliced = _tensors(next((tmp_path / "sliced").iterdir()), rng=False)
    assert whole.keys() == sliced.keys() and any("@7" in k for k in sliced)
    for k in whole:  # the same training, summed in another order
        torch.testing.assert_close(sliced[k], whole[k], rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
    reference = json.loads((tmp_path / "losses_sliced_w4.json").read_text())
    _case_resume(0, 1, str(tmp_path), "sliced", "sliced_w1")
    spawn_ranks(2, __name__, "resume", str(tmp_path), "sliced", "sliced_w2")
    spawn_ranks(2, __name__, "resume", str(tmp_path), "resaved_sliced_w1", "sliced_w2_split", 2)
    _assert_same_bits(tmp_path / "sliced", tmp_path / "resaved_sliced_w1")  # joined and cut again
    _assert_losses(tmp_path, ("sliced_w1", "sliced_w2", "sliced_w2_split"), reference)


@pytest.mark.distributed
def test_hidden_sharded_save_refuses_state_that_differs_between_ranks(tmp_path):
    spawn_ranks(2, __name__, "sliced_state_differs", str(tmp_path))


def _torchrun(root: Path, *extra: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=5",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           str(Path(__file__).resolve().parent / "elastic_train.py"), str(root), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow  # ~13 s; test_train_launch kills ranks by default (stale store keys, fixed in init_distributed)
def test_killed_rank_restarts_from_last_checkpoint(tmp_path):
    """torchrun restarts the job after rank 1 is SIGKILLed; it resumes and ends with the
    uninterrupted run's losses."""
    _torchrun(tmp_path / "clean")
    _torchrun(tmp_path / "killed", "--kill-rank-at-step", "4")
    clean = json.loads((tmp_path / "clean" / "losses.json").read_text())
    killed = json.loads((tmp_path / "killed" / "losses.json").read_text())
    assert clean["attempt"] == 0 and killed["attempt"] >= 1  # the second run really restarted
    assert len(killed["losses"]) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(killed["losses"]), torch.tensor(clean["losses"]), rtol=1e-10, atol=1e-10)


@pytest.mark.reference
@pytest.mark.parametrize("seed", [0, 1])
def test_describe_lists_every_file_and_tensor_group_as_written(tmp_path, seed):
    """``describe_checkpoint`` (``moeflow convert --info``) of a checkpoint of random shapes on a
    random number of files: the header, each file's tensor count, size and sha256 as on disk,
    each tensor group with its dtype, shape and expert count, the experts and the user's extra,
    and nothing else (no experts line without experts, no extra line without extra)."""
    import hashlib

    from moeflow.checkpoint import describe_checkpoint

    gen = torch.Generator().manual_seed(seed)
    E, D, H, world = (int(v) for v in (4 * torch.randint(1, 3, (1,), generator=gen), 2 * torch.randint(2, 6, (1,), generator=gen),
                                       2 * torch.randint(2, 6, (1,), generator=gen), 2 ** torch.randint(0, 3, (1,), generator=gen)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(D, D, bias=False, dtype=torch.float64),
                                moeflow.MoE(dim=D, hidden=H, num_experts=E, top_k=2, dtype=torch.float64))
    extra = {"pos": int(torch.randint(0, 1000, (1,), generator=gen)), "tag": "x" * 70} if seed == 0 else None
    step = int(torch.randint(0, 10**6, (1,), generator=gen))
    path = reshard_checkpoint(save_checkpoint(tmp_path / "w1", step, model, extra=extra), tmp_path / "w", world)
    files = sorted(path.glob("*.safetensors"))
    want = [f"{path}: step {step}, written by {world} rank(s), format moeflow-checkpoint/1"]
    groups: dict[str, str] = {}
    counts: dict[str, int] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            for k in keys:
                t = f.get_tensor(k)
                base = k.split("@")[0]
                groups[base] = f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
                counts[base] = counts.get(base, 0) + ("@" in k)
        want.append(f"  {file.name}: {len(keys)} tensors, {file.stat().st_size} bytes, "
                    f"sha256 {hashlib.sha256(file.read_bytes()).hexdigest()[:12]}")
    want.append("  tensors:")
    want += [f"    {b}: {groups[b]}" + (f" x {counts[b]} experts" if counts[b] else "") for b in sorted(groups)]
    want.append(f"  MoE expert parameters: 1.experts.w_in (E={E}), 1.experts.w_out (E={E})")
    if extra:
        want.append(f"  extra: {json.dumps(extra)}")
    assert describe_checkpoint(path).split("\n") == want
    assert counts["param/1.experts.w_in"] == E and len(files) == world
    # a model without experts: no experts line
    plain = save_checkpoint(tmp_path / "plain", 1, torch.nn.Linear(D, 3))
    assert not [line for line in describe_checkpoint(plain).split("\n") if "MoE" in line or "experts" in line]


@pytest.mark.reference
@pytest.mark.parametrize("seed", [0, 1])
def test_reshard_puts_each_tensor_in_its_rank_file_and_keeps_each_ranks_rng(tmp_path, seed):
    """``reshard_checkpoint`` of a checkpoint written by 4 ranks (every rank's RNG state) to 2
    ranks and to 1: each expert in the file of the rank that holds it, dense tensors in rank 0's,
    each rank's RNG state in its own file while the rank exists (the others are dropped: the
    index stays valid), every tensor bit for bit, whatever a parameter's name holds (torch
    allows '/'); a bad world size is refused before anything is written, and the destination
    keeps the last ``keep`` (default 3) steps."""
    gen = torch.Generator().manual_seed(seed)
    E = 4 * int(torch.randint(1, 3, (1,), generator=gen))
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"in/0": torch.nn.Linear(8, 8, dtype=torch.float64),
                                 "blocks/0": moeflow.MoE(dim=8, hidden=8, num_experts=E, top_k=2, dtype=torch.float64)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model["blocks/0"](model["in/0"](torch.randn(6, 8, dtype=torch.float64, generator=gen))).square().sum().backward()
    opt.step()
    step = int(torch.randint(1, 1000, (1,), generator=gen))
    src = reshard_checkpoint(save_checkpoint(tmp_path / "w1", step, model, opt), tmp_path / "w4", 4)
    # as if 4 ranks had saved it: rank r's RNG state in rank r's file (the index rewritten to match)
    index = read_index(src)
    rngs = {r: torch.randint(0, 256, (16,), dtype=torch.uint8, generator=gen) for r in range(1, 4)}
    for r in range(1, 4):
        with safe_open(str(src / index["files"][r]["file"]), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tensors[f"rng/rank{r}/cpu"] = rngs[r]
        index["files"][r] = _write_tensors(src / index["files"][r]["file"], tensors)
    (src / "index.json").write_text(json.dumps(index))
    saved = _tensors(src)
    assert {k for k in saved if k.startswith("rng/")} == {f"rng/rank{r}/cpu" for r in range(4)}

    for world in (2, 1):
        out = reshard_checkpoint(src, tmp_path / f"to{world}", world)
        files = read_index(out)["files"]  # a valid index (no RNG state of a rank it does not have)
        assert read_index(out)["world_size"] == world and len(files) == world
        for r, entry in enumerate(files):
            with safe_open(str(out / entry["file"]), framework="pt") as f:
                for k in f.keys():
                    if "@" in k:
                        assert int(k.rsplit("@", 1)[1]) // (E // world) == r, k
                    elif k.startswith("rng/"):
                        assert k == f"rng/rank{r}/cpu", k
                    else:
                        assert r == 0, k
                    assert torch.equal(f.get_tensor(k), saved[k]), k
        assert set(_tensors(out)) == {k for k in saved if not k.startswith("rng/rank") or int(k[8]) < world}
    # the one-file checkpoint loads into the model, its optimizer and rank 0's RNG state
    fresh = torch.nn.ModuleDict({"in/0": torch.nn.Linear(8, 8, dtype=torch.float64),
                                 "blocks/0": moeflow.MoE(dim=8, hidden=8, num_experts=E, top_k=2, dtype=torch.float64)})
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    load_checkpoint(tmp_path / "to1", fresh, fresh_opt)
    assert torch.equal(torch.get_rng_state(), saved["rng/rank0/cpu"])
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert all(torch.equal(opt.state[p][k], fresh_opt.state[q][k]) for k in opt.state[p])

    for bad in (0, -int(torch.randint(1, 9, (1,), generator=gen)), True, 2.0, "2"):
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            reshard_checkpoint(src, tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()
    # the destination keeps the newest 3 steps by default
    steps = sorted(int(s) for s in torch.randperm(50, generator=gen)[:4] + 1)
    for s in steps:
        reshard_checkpoint(save_checkpoint(tmp_path / "many", s, model, keep=10), tmp_path / "kept", 2)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [f"step-{s:08d}" for s in steps[-3:]]


class _CountingSGD(torch.optim.SGD):
    """SGD that also keeps non-tensor state per parameter (an int and a float), as custom
    optimizers do: the checkpoint holds it in the index, not in a file."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["calls"] = state.get("calls", 0) + 1
                    state["last_norm"] = float(p.grad.norm())
        return out


@pytest.mark.reference
@pytest.mark.parametrize("seed", [0, 1])
def test_optimizer_state_comes_back_per_parameter_with_its_scalars_and_gaps(tmp_path, seed):
    """An optimizer's state loads back parameter by parameter: tensors and non-tensor values (a
    custom optimizer's counters) each to their own parameter, and a parameter that never had a
    gradient (no state at all) is left without state, on random steps of a model with a
    parameter the loss does not reach."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8, dtype=torch.float64),
                                 "moe": moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, dtype=torch.float64),
                                 "unused": torch.nn.Linear(8, 3, dtype=torch.float64)})
    opt = _CountingSGD(model.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
        opt.zero_grad()
        model["moe"](model["a"](torch.randn(6, 8, dtype=torch.float64, generator=gen))).square().sum().backward()
        if torch.rand((), generator=gen) < 0.5:
            model["a"].bias.grad = None  # one parameter skips a step: its counter differs
        opt.step()
    path = save_checkpoint(tmp_path, 1, model, opt)
    fresh = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8, dtype=torch.float64),
                                 "moe": moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, dtype=torch.float64),
                                 "unused": torch.nn.Linear(8, 3, dtype=torch.float64)})
    fresh_opt = _CountingSGD(fresh.parameters(), lr=1.0, momentum=0.5)
    load_checkpoint(path, fresh, fresh_opt)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        if name.startswith("unused"):
            assert not opt.state.get(p) and q not in fresh_opt.state, name
            continue
        assert opt.state[p].keys() == fresh_opt.state[q].keys() == {"momentum_buffer", "calls", "last_norm"}, name
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"]), name
        assert (fresh_opt.state[q]["calls"], fresh_opt.state[q]["last_norm"]) == \
            (opt.state[p]["calls"], opt.state[p]["last_norm"]), name
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and fresh_opt.param_groups[0]["momentum"] == 0.9


class _ColumnAdamW(torch.optim.AdamW):
    """AdamW that also keeps a factored optimizer's column statistic ([D] for a [V, D] table)."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    self.state[p]["col"] = p.grad.square().mean(0)
        return out


@pytest.mark.reference
@pytest.mark.parametrize("seed", [0, 1])
def test_loaded_state_lands_on_the_parameters_device_and_a_vocab_shard_takes_its_rows(tmp_path, seed):
    """Loaded optimizer state is on each parameter's device (a model built on ``meta``: every
    state tensor on ``meta``, experts' and dense ones), and a vocabulary shard (rows
    ``[start, start + n)`` of the table, ``mark_vocab_shard``) takes its rows of the saved table
    and of every state shaped like it, while the state of another shape (Adam's step, a
    factored optimizer's [D] column statistic) comes whole, for a random start."""
    from moeflow.parallel.vocab import mark_vocab_shard

    gen = torch.Generator().manual_seed(seed)
    model, opt = _trained(1)
    path = save_checkpoint(tmp_path / "moe", 1, model, opt)
    with torch.device("meta"):
        fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(path, fresh, fresh_opt)
    assert fresh_opt.state and all(v.device.type == "meta" for s in fresh_opt.state.values() for v in s.values())
    assert {id(p) for p in fresh_opt.state} == {id(p) for p in fresh.parameters()}

    V, D = (int(v) for v in torch.randint(6, 12, (2,), generator=gen))
    n = int(torch.randint(2, V - 2, (1,), generator=gen))
    start = int(torch.randint(1, V - n + 1, (1,), generator=gen))
    torch.manual_seed(seed)
    table = torch.nn.Embedding(V, D, dtype=torch.float64)
    table_opt = _ColumnAdamW(table.parameters(), lr=1e-2)
    table(torch.randint(0, V, (20,), generator=gen)).square().sum().backward()
    table_opt.step()
    path = save_checkpoint(tmp_path / "table", 1, table, table_opt)
    shard = torch.nn.Embedding(n, D, dtype=torch.float64)
    mark_vocab_shard(shard.weight, start, V)
    shard_opt = _ColumnAdamW(shard.parameters(), lr=1.0)
    load_checkpoint(path, shard, shard_opt)
    rows = slice(start, start + n)
    assert torch.equal(shard.weight, table.weight[rows])
    saved, loaded = table_opt.state[table.weight], shard_opt.state[shard.weight]
    assert loaded.keys() == saved.keys() == {"step", "exp_avg", "exp_avg_sq", "col"}
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded[k], saved[k][rows]), k
    for k in ("step", "col"):
        assert torch.equal(loaded[k], saved[k]), k
