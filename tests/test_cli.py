"""``moeflow train`` and ``moeflow generate`` end to end, the errors of both commands (checked
before any rank starts), and ``--out`` holding one run (refused, resumed, finished, overwritten)
alike with one process and with ``--nproc 2``. The other commands are tested with their subject: ``bench`` in
test_bench.py, ``convert`` in test_checkpoint.py and test_convert_mixtral.py, ``infer`` in
test_storage.py, ``train-vision`` in test_train_vision.py."""

from __future__ import annotations

import json

import pytest
import torch

import moeflow
from moeflow.checkpoint import CheckpointError, save_checkpoint
from moeflow.cli.main import main
from moeflow.train import build_from_checkpoint

from helpers import file_states

pytestmark = pytest.mark.e2e


def test_cli_generate_and_its_errors(tmp_path, capsys) -> None:
    torch.set_num_threads(2)
    rc = main(["train", "--out", str(tmp_path / "run"), "--steps", "3", "--batch-size", "4", "--seq-len", "32",
               "--eval-batches", "1", "--no-progress", "--no-plot", "--sample-tokens", "10"])
    out = capsys.readouterr().out
    assert rc == 0 and "validation loss (held-out works) before training" in out and "sample" in out
    assert main(["generate", str(tmp_path / "run"), "--tokens", "5", "--prompt", "HAMLET."]) == 0
    assert capsys.readouterr().out.startswith("HAMLET.")

    # a checkpoint of something else than `moeflow train`'s model
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=2, top_k=1)
    save_checkpoint(tmp_path / "other", 1, layer)
    assert main(["generate", str(tmp_path / "other")]) == 2
    assert "not a moeflow.MoEGPT checkpoint" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="family"):
        build_from_checkpoint(tmp_path / "other")

    # a corrupt model description in the index
    ck = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    index = json.loads((ck / "index.json").read_text())
    index["extra"]["model"]["n_heads"] = 5
    (ck / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="corrupt model"):
        build_from_checkpoint(ck)

    assert main(["generate", str(tmp_path / "missing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "x"), "--val-works", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "x"), "--batch-size", "6", "--grad-accum", "4"]) == 2
    assert "grad_accum" in capsys.readouterr().err
    # placement and vocabulary flags are checked before any rank starts
    for flags, needle in ((["--vocab-parallel"], "--nproc >= 2"), (["--rebalance-every", "5"], "--nproc >= 2"),
                          (["--nproc", "2", "--rebalance-every", "5", "--expert-slots", "9"], "[4, 8], got 9"),
                          (["--nproc", "2", "--expert-slots", "5"], "applies with --rebalance-every")):
        assert main(["train", "--out", str(tmp_path / "x"), *flags]) == 2
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize("nproc", [1, 2])
def test_cli_out_holds_one_run(tmp_path, capsys, nproc: int) -> None:
    """One process and 2 torchrun ranks behave the same; every refusal comes before a rank starts."""
    torch.set_num_threads(2)
    out = tmp_path / "run"

    def train(*flags: str) -> int:
        ranks = ["--nproc", "2"] if nproc == 2 else []
        return main(["train", "--out", str(out), *ranks, "--batch-size", "4", "--seq-len", "32", "--eval-batches", "1",
                     "--no-progress", "--no-plot", "--sample-tokens", "0", *flags])

    def history() -> dict:
        return json.loads((out / "history.json").read_text())

    assert train("--steps", "2") == 0
    first = history()
    (out / "notes.txt").write_text("not moeflow's")
    before = file_states(out)
    capsys.readouterr()
    assert train("--steps", "2") == 2
    assert "already holds a run" in capsys.readouterr().err
    assert train("--steps", "1", "--resume") == 2
    assert "steps=1 is below step 2" in capsys.readouterr().err
    assert train("--steps", "2", "--resume") == 0
    assert "already finished step 2 of --steps 2" in capsys.readouterr().out
    assert file_states(out) == before

    assert train("--steps", "3", "--resume") == 0
    resumed = history()
    assert resumed["step"] == [1, 2, 3] and resumed["run_id"] == first["run_id"] and resumed["world_size"] == nproc
    assert resumed["train_loss"][:2] == first["train_loss"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]

    assert train("--steps", "1", "--overwrite") == 0
    assert history()["run_id"] != first["run_id"] and (out / "notes.txt").read_text() == "not moeflow's"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
