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


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys) -> None:
    """How a command fails (``moeflow.cli.errors``): a ``UsageError`` is its one line and status;
    an exception a handler did not expect is one line saying so (status 1); ``--debug``, before
    or after the command, lets it through with its traceback."""
    import moeflow.cli.train as train_cli
    from moeflow.cli.errors import UsageError

    argv = ["train", "--out", str(tmp_path / "run"), "--steps", "1"]

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise UsageError("--steps 1: not today\nsecond line", status=3)

    monkeypatch.setattr(train_cli, "_refusal", refuse)
    assert main(argv) == 3
    assert capsys.readouterr().err == "moeflow train: error: --steps 1: not today | second line\n"

    def bug(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyError("a bug")

    monkeypatch.setattr(train_cli, "_refusal", bug)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("moeflow train: error: unexpected KeyError: 'a bug'") and "--debug" in err
    assert len(err.splitlines()) == 1
    for debug in (["--debug", *argv], [*argv, "--debug"]):
        with pytest.raises(KeyError, match="a bug"):
            main(debug)
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as done:  # a bad flag: argparse's line, without the usage block
        main(["train", "--lr", "nan"])
    assert done.value.code == 2
    assert capsys.readouterr().err == ("moeflow train: error: argument --lr: must be a finite number, got 'nan' "
                                       "(see moeflow train --help)\n")


@pytest.mark.parametrize("what", ["help", "a2a-model", "convert-info"])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, what: str) -> None:
    """``moeflow convert --info | head`` (the reader gone before the output): nothing on stderr
    (no BrokenPipeError traceback, from the command or from the flush at exit) and status 1."""
    import os
    import subprocess
    import sys

    ck = save_checkpoint(tmp_path / "ck", 1, moeflow.MoE(dim=8, hidden=8, num_experts=2, top_k=1))
    argv = {"help": ["--help"], "a2a-model": ["a2a-model"], "convert-info": ["convert", str(ck), "--info"]}[what]
    read, write = os.pipe()
    os.close(read)  # the reader has gone: every write fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "moeflow", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == "", done.stderr
    assert done.returncode == (0 if what == "help" else 1)  # argparse's help ignores the failed write


def test_nonfinite_loss_stops_every_rank_under_nproc(tmp_path, capfd) -> None:
    """``moeflow train --nproc 2`` with a learning rate that overflows the weights in step 1:
    every rank stops at step 2 (its gradient is nan) and exits 1; rank 0 says so once, the
    step-1 checkpoint is kept and nothing is saved after it."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--nproc", "2", "--lr", "1e30", "--warmup", "1", "--steps", "4",
                 "--checkpoint-every", "1", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1",
                 "--no-progress", "--no-plot", "--sample-tokens", "0"]) == 1
    err = capfd.readouterr().err
    assert err.count("moeflow train: error: training stopped at step 2") == 1, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
    assert json.loads((out / "history.json").read_text())["skipped"][0][0] == 2
