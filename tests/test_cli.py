"""``moeflow train`` and ``moeflow generate`` end to end, and the errors of both commands (checked
before any rank starts). The other commands are tested with their subject: ``bench`` in
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
