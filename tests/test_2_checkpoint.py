"""Tier 2: checkpoints in one process: round trip, corruption, crashes, resharding, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
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

ROOT = Path(__file__).resolve().parents[1]


def _model(E: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8, dtype=torch.float64),
        moeflow.MoE(dim=8, hidden=8, num_experts=E, top_k=2, capacity_factor=0, dtype=torch.float64,
                    router=moeflow.RouterConfig(bias_update_rate=1e-3)),
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


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for entry in read_index(path)["files"]:
        with safe_open(str(path / entry["file"]), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


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


def test_keep_last_n_and_latest(tmp_path):
    model, opt = _trained(1)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]
    assert latest_checkpoint(tmp_path).name == "step-00000004"
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(tmp_path, 4, model, opt)


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


@pytest.mark.parametrize("how,match", [("flip", "sha256"), ("truncate", "truncated"), ("delete", "missing")])
def test_damaged_files_are_named(tmp_path, how, match):
    path = _corrupt_case(tmp_path, how)
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(path, _model())
    assert "rank00000-of-00001.safetensors" in str(err.value)


def test_removed_expert_is_named(tmp_path):
    model, opt = _trained(1)
    path = save_checkpoint(tmp_path, 1, model, opt)
    index = read_index(path)
    entry = index["files"][0]
    tensors = _all_tensors(path)
    del tensors["param/1.experts.w_in@2"]
    index["files"][0] = _write_tensors(path / entry["file"], tensors)  # a consistent but incomplete checkpoint
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"expert 2 of 1.experts.w_in is missing"):
        load_checkpoint(path, _model())


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
    from test_2_checkpoint import _trained
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
    else:
        io._finalize = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    save_checkpoint({root!r}, 2, model, opt)
    """
)


@pytest.mark.parametrize("where", ["mid-file", "before-index"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, where):
    script = _CRASH.format(tests=str(ROOT / "tests"), root=str(tmp_path), where=where)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr  # killed by SIGKILL
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert [p.name for p in partial_checkpoints(tmp_path)] == [".tmp-step-00000002"]
    info = load_checkpoint(tmp_path, _model(), None)  # verifies every checksum it reads
    assert info["step"] == 1
    # the next save of step 2 replaces the leftovers
    model, opt = _trained(1)
    save_checkpoint(tmp_path, 2, model, opt)
    assert partial_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path).name == "step-00000002"


def test_reshard_round_trip_is_exact(tmp_path):
    model, opt = _trained(2, E=8)
    src = save_checkpoint(tmp_path / "w1", 2, model, opt)
    four = reshard_checkpoint(src, tmp_path / "w4", 4)
    assert len(read_index(four)["files"]) == 4
    one = reshard_checkpoint(four, tmp_path / "w1b", 1)
    four_again = reshard_checkpoint(one, tmp_path / "w4b", 4)
    a, b = _all_tensors(src), _all_tensors(four_again)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # expert g of 8 lives in rank file g // 2 of a 4-rank layout
    index = read_index(four)
    assert "param/1.experts.w_in@5" in index["files"][2]["tensors"]
    with pytest.raises(ValueError, match="does not divide"):
        reshard_checkpoint(src, tmp_path / "w3", 3)


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


def test_index_is_plain_json_and_files_are_safetensors(tmp_path):
    model, opt = _trained(1)
    path = save_checkpoint(tmp_path, 1, model, opt)
    assert sorted(os.listdir(path)) == ["index.json", "rank00000-of-00001.safetensors"]
    index = json.loads((path / "index.json").read_text())
    assert index["experts"] == {"1.experts.w_in": 4, "1.experts.w_out": 4}
