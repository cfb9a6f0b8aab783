"""``moeflow train`` and ``moeflow generate`` end to end, the errors of both commands (checked
before any rank starts), and ``--out`` holding one run (refused, resumed, finished, overwritten)
alike with one process and with ``--nproc 2``; the ``--device`` default (CUDA where available)
and one GPU per rank, on a CUDA faked here (``torch.cuda.is_available``/``device_count``). The
runs name ``--device cpu``: they test the CPU path on any machine. The other commands are tested
with their subject: ``bench`` in test_bench.py, ``convert`` in test_checkpoint.py and
test_convert_mixtral.py, ``infer`` in test_storage.py, ``train-vision`` in test_train_vision.py."""

from __future__ import annotations

import json

import pytest
import torch

import moeflow
from moeflow.checkpoint import CheckpointError, read_index, save_checkpoint
from moeflow.cli.main import main
from moeflow.train import build_from_checkpoint

from helpers import file_states

# tiers per test: the command runs are e2e, the device choice with a faked CUDA is unit


@pytest.mark.e2e
def test_cli_generate_and_its_errors(tmp_path, capsys) -> None:
    rc = main(["train", "--device", "cpu", "--out", str(tmp_path / "run"), "--steps", "3", "--batch-size", "4",
               "--seq-len", "32", "--eval-batches", "1", "--no-progress", "--no-plot", "--sample-tokens", "10"])
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


@pytest.mark.e2e
@pytest.mark.parametrize("nproc", [1, 2])
def test_cli_out_holds_one_run(tmp_path, capsys, nproc: int) -> None:
    """One process and 2 torchrun ranks behave the same; every refusal comes before a rank starts.
    ``--overwrite`` runs on one process here: on 2 ranks it is the same first call of
    ``train_lm`` on each, which ``tests/test_train_lm.py::test_out_dir_rules_hold_on_two_ranks``
    runs on 2 gloo ranks (a third job of torchrun ranks here was ~20 s of CPU)."""
    out = tmp_path / "run"

    def train(*flags: str) -> int:
        ranks = ["--nproc", "2"] if nproc == 2 else []
        return main(["train", "--device", "cpu", "--out", str(out), *ranks, "--batch-size", "4", "--seq-len", "32",
                     "--eval-batches", "1", "--no-progress", "--no-plot", "--sample-tokens", "0", *flags])

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

    if nproc == 2:
        return
    assert train("--steps", "1", "--overwrite") == 0
    assert history()["run_id"] != first["run_id"] and (out / "notes.txt").read_text() == "not moeflow's"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]


@pytest.mark.e2e
def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys) -> None:
    """How a command fails (``moeflow.cli.errors``): a ``UsageError`` is its one line and status;
    an exception a handler did not expect is one line saying so (status 1); ``--debug``, before
    or after the command, lets it through with its traceback."""
    import moeflow.cli.train as train_cli
    from moeflow.cli.errors import UsageError

    argv = ["train", "--device", "cpu", "--out", str(tmp_path / "run"), "--steps", "1"]

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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_nonfinite_loss_stops_every_rank_under_nproc(tmp_path, capfd) -> None:
    """``moeflow train --nproc 2`` with a learning rate that overflows the weights in step 1:
    every rank stops at step 2 (its gradient is nan) and exits 1; rank 0 says so once, the
    step-1 checkpoint is kept and nothing is saved after it."""
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--out", str(out), "--nproc", "2", "--lr", "1e30", "--warmup", "1",
                 "--steps", "4", "--checkpoint-every", "1", "--batch-size", "4", "--seq-len", "16",
                 "--eval-batches", "1", "--no-progress", "--no-plot", "--sample-tokens", "0"]) == 1
    err = capfd.readouterr().err
    assert err.count("moeflow train: error: training stopped at step 2") == 1, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
    assert json.loads((out / "history.json").read_text())["skipped"][0][0] == 2


@pytest.mark.e2e
def test_threads_follow_omp_num_threads(tmp_path, monkeypatch, capsys) -> None:
    """--threads defaults to OMP_NUM_THREADS when it is set (else 2), and --help says which."""
    from moeflow.cli.main import build_parser

    before = torch.get_num_threads()
    try:
        for env, expected in (("1", 1), (None, 2), ("x", 2)):
            if env is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            torch.set_num_threads(3)
            assert main(["train", "--device", "cpu", "--out", str(tmp_path / f"run{expected}{env}"), "--steps", "1",
                         "--batch-size", "2", "--seq-len", "8", "--eval-batches", "1", "--no-plot",
                         "--sample-tokens", "0"]) == 0
            assert torch.get_num_threads() == expected
            sub = build_parser()._subparsers._group_actions[0].choices["train"]
            threads = next(a for a in sub._actions if a.dest == "threads")
            assert (f"in effect now: {expected}" in threads.help
                    and ("from OMP_NUM_THREADS" in threads.help) == (env == "1"))
        torch.set_num_threads(3)
        assert main(["train", "--device", "cpu", "--out", str(tmp_path / "explicit"), "--threads", "2", "--steps", "1",
                     "--batch-size", "2", "--seq-len", "8", "--eval-batches", "1", "--no-plot",
                     "--sample-tokens", "0"]) == 0
        assert torch.get_num_threads() == 2  # a flag beats the environment
    finally:
        torch.set_num_threads(before)


@pytest.mark.e2e
def test_progress_lines_and_metrics_jsonl(tmp_path, capsys) -> None:
    """Not on a terminal: plain progress lines, the validation loss before training printed
    before the first step's line; metrics.jsonl holds every step once, also after a resume."""
    from moeflow.train.metrics import read_metrics

    out = tmp_path / "run"
    flags = ["train", "--device", "cpu", "--out", str(out), "--batch-size", "4", "--seq-len", "16",
             "--eval-batches", "1", "--eval-every", "2", "--log-every", "2", "--no-plot", "--sample-tokens", "0",
             "--warmup", "1"]
    assert main([*flags, "--steps", "4"]) == 0
    text = capsys.readouterr().out
    assert "\r" not in text
    lines = text.splitlines()
    first_val = next(i for i, line in enumerate(lines) if line.startswith("before training: validation loss"))
    step2 = next(i for i, line in enumerate(lines) if line.startswith("step 2/4: loss"))
    assert first_val < step2 and "tokens/s, max_load" in lines[step2]
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all({"lr", "grad_norm", "aux_loss", "tokens_per_s", "time_s"} <= r.keys() for r in steps)
    assert [r["step"] for r in steps if "max_load" in r] == [2, 4] and all(r["max_load"] >= 1 for r in steps[1::2])
    history = json.loads((out / "history.json").read_text())
    assert [r["loss"] for r in steps] == history["train_loss"] and [r["lr"] for r in steps] == history["lr"]
    assert [[r["step"], r["val_loss"]] for r in records if "val_loss" in r] == history["val"]
    # records past the checkpoint (a run that died after its last save) are cut back on resume
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 5, "loss": 9.0}) + "\n")
    assert main([*flags, "--steps", "6", "--resume"]) == 0
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.e2e
def test_tensorboard_logs_the_metrics_or_is_refused(tmp_path, capsys) -> None:
    """--tensorboard: the scalars of metrics.jsonl in --out/tensorboard when the tensorboard
    package is installed; else refused before any work, saying what to install."""
    from moeflow.train.metrics import read_metrics, tensorboard_missing

    out = tmp_path / "run"
    rc = main(["train", "--device", "cpu", "--out", str(out), "--steps", "3", "--batch-size", "2", "--seq-len", "8",
               "--eval-batches", "1", "--no-plot", "--sample-tokens", "0", "--warmup", "1", "--tensorboard"])
    if tensorboard_missing() is not None:
        assert rc == 2 and "pip install 'moeflow[tensorboard]'" in capsys.readouterr().err and not out.exists()
        return
    assert rc == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    expected = [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [s for s, _ in logged] == [s for s, _ in expected] == [1, 2, 3]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [e.step for e in events.Scalars("val/loss")] == [0, 3]


@pytest.mark.e2e
def test_short_run_reaches_the_peak_lr_or_is_told(tmp_path, capsys) -> None:
    """The default --warmup 30 in a 5-step run is cut to a tenth of the run, with a note; an
    explicit --warmup above --steps is refused before any work."""
    out = tmp_path / "run"
    flags = ["--batch-size", "2", "--seq-len", "8", "--eval-batches", "1", "--no-plot", "--sample-tokens", "0"]
    assert main(["train", "--device", "cpu", "--out", str(out), "--steps", "5", "--lr", "2e-3", *flags]) == 0
    text = capsys.readouterr().out
    assert "note: --steps 5 is not above the default --warmup 30: warming up over 0 step(s)" in text
    assert max(json.loads((out / "history.json").read_text())["lr"]) == pytest.approx(2e-3)
    assert main(["train", "--device", "cpu", "--out", str(tmp_path / "r2"), "--steps", "5", "--warmup", "6", *flags]) == 2
    out_, err = capsys.readouterr()
    assert out_ == "" and "--warmup 6 is above --steps 5" in err and not (tmp_path / "r2").exists()
    assert main(["train", "--device", "cpu", "--out", str(tmp_path / "r3"), "--steps", "3", "--warmup", "3", *flags]) == 0
    assert "note:" not in capsys.readouterr().out
    assert json.loads((tmp_path / "r3" / "history.json").read_text())["lr"][-1] == pytest.approx(3e-3)


@pytest.mark.e2e
def test_help_states_every_default_and_version(capsys) -> None:
    """Every option of train, train-vision and infer that has a default says it in --help;
    train's help explains max_load; --version prints the package version."""
    from moeflow.cli.main import _HelpFormatter, build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("train", "train-vision", "infer"):
        for action in commands[name]._actions:
            if action.option_strings and action.dest not in ("help", "debug") and not isinstance(action.default, bool):
                text = _HelpFormatter(name)._get_help_string(action)
                assert action.help and "default" in text.lower(), (name, action.option_strings, text)
    train_help = commands["train"].format_help()
    assert "(default: 300)" in train_help and "over the even share 1/E" in train_help and "router's k" in train_help
    for name in ("train", "generate", "infer", "bench"):  # --device: CUDA where available, said in --help
        device_help = " ".join(commands[name].format_help().split())
        assert "default: cuda when torch.cuda.is_available(), else cpu" in device_help, name
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"moeflow {moeflow.__version__}"


@pytest.mark.e2e
def test_config_file_flags_override_it_and_the_run_writes_it_back(tmp_path, capsys) -> None:
    """--config run.toml sets the flags its keys name; the command line wins; the run writes its
    effective flags to --out/config.toml, which --config reads back to the same settings."""
    config = tmp_path / "run.toml"
    config.write_text('steps = 2\nbatch_size = 4\nseq_len = 16\neval_batches = 1\nplot = false\nsample_tokens = 0\n'
                      'val_works = ["hamlet", "sonnets"]\nlr = 0.002\nwarmup_steps = 1\nnum_experts = 4\n')
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--config", str(config), "--out", str(out), "--lr", "0.001"]) == 0
    capsys.readouterr()
    run = json.loads((out / "history.json").read_text())
    assert run["step"] == [1, 2] and run["lr"][0] == pytest.approx(0.001)  # the flag beat the file's 0.002
    saved = read_index(run["checkpoint"])["extra"]
    assert saved["model"]["num_experts"] == 4 and saved["train"]["val_works"] == ["hamlet", "sonnets"]
    written = (out / "config.toml").read_text()
    assert "lr = 0.001\n" in written and "num_experts = 4\n" in written and "resume" not in written
    # read back (to another --out): the same effective settings
    again = tmp_path / "again"
    assert main(["train", "--device", "cpu", "--config", str(out / "config.toml"), "--out", str(again)]) == 0
    capsys.readouterr()
    rerun = read_index(json.loads((again / "history.json").read_text())["checkpoint"])["extra"]["train"]
    assert {k: v for k, v in rerun.items() if k != "out_dir"} == {k: v for k, v in saved["train"].items()
                                                                  if k != "out_dir"}


@pytest.mark.e2e
def test_init_from_a_converted_model(tmp_path, capsys) -> None:
    """train --init-from the output of convert --from-hf (a Mixtral directory): the model is the
    converted one, trained on bytes; its validation loss before training is that model's."""
    from moeflow.convert.mixtral import gpt_to_hf
    from moeflow.models import MoEGPT, gpt_config
    from moeflow.train import LMTrainConfig
    from moeflow.train.data import ByteTokenizer, load_corpus
    from moeflow.train.tokens import TokenStream
    from moeflow.train.lm_setup import evaluate

    torch.manual_seed(3)
    model = MoEGPT(gpt_config("tiny", vocab_size=300, n_layers=1, dim=32, n_heads=2, expert_hidden=32,
                              num_experts=4, max_seq_len=64))
    hf = gpt_to_hf(model, tmp_path / "hf")
    assert main(["convert", "--from-hf", str(hf), str(tmp_path / "converted")]) == 0
    out = tmp_path / "ft"
    assert main(["train", "--device", "cpu", "--init-from", str(tmp_path / "converted"), "--out", str(out),
                 "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "2", "--no-plot",
                 "--sample-tokens", "0"]) == 0
    capsys.readouterr()
    history = json.loads((out / "history.json").read_text())
    cfg = LMTrainConfig(out_dir=out, batch_size=2, seq_len=16, eval_batches=2)
    val = TokenStream.from_text(load_corpus(cfg.val_works).val_text, ByteTokenizer(), 16, cfg.seed + 1)
    assert history["val"][0][1] == pytest.approx(evaluate(model, val, cfg, None, torch.device("cpu")), rel=1e-6)
    saved = read_index(history["checkpoint"])["extra"]
    assert saved["model"]["vocab_size"] == 300 and saved["tokenizer"]["kind"] == "byte"


# ----------------------------------------------------------------------------- the device


def _fake_cuda(monkeypatch, count: int) -> None:
    """This machine has ``count`` CUDA devices, as far as the device checks ask torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.unit
def test_device_defaults_to_cuda_where_available_and_says_why(monkeypatch) -> None:
    from moeflow.cli.errors import UsageError
    from moeflow.cli.flags import choose_device, default_device

    _fake_cuda(monkeypatch, 0)
    assert default_device() == "cpu"
    none = choose_device("--device", None)
    assert (none.device, none.line) == ("cpu", "device: cpu (default: CUDA is not available)")
    with pytest.raises(UsageError, match="--device 'cuda': CUDA is not available"):
        choose_device("--device", "cuda")
    _fake_cuda(monkeypatch, 2)
    assert default_device() == "cuda"
    one = choose_device("--device", None)
    assert (one.device, one.line) == ("cuda:0", "device: cuda:0 (default: CUDA is available)")
    assert choose_device("--device", "cuda:1").line == "device: cuda:1 (--device cuda:1)"
    assert choose_device("--device", "cpu").line == "device: cpu (--device cpu)"  # a GPU machine, on the CPU
    # a torchrun rank: its own GPU, cuda:LOCAL_RANK, given as cuda or by default
    for given in (None, "cuda"):
        rank1 = choose_device("--device", given, ranks=2, local_rank=1, ranks_from="torchrun")
        assert rank1.device == "cuda:1" and rank1.line.startswith("device: cuda:1 on this rank")
    # the process that starts --nproc 2: the plan, one GPU per rank
    plan = choose_device("--device", None, ranks=2, ranks_from="--nproc 2")
    assert (plan.device, plan.line) == ("cuda", "device: cuda:0..cuda:1, one GPU per rank (default: CUDA is available)")
    assert choose_device("--device", "cuda:0", ranks=1, local_rank=0).device == "cuda:0"  # the only rank's own
    for index, ranks in (("cuda:0", 2), ("cuda:1", 2), ("cuda:1", 1)):  # one index cannot be every rank's
        with pytest.raises(UsageError, match=rf"--device {index}: under torchrun \(--nproc {ranks}\) each rank uses"):
            choose_device("--device", index, ranks=ranks, ranks_from=f"--nproc {ranks}")
    assert choose_device("--device", "cpu", ranks=8).device == "cpu"  # gloo ranks need no GPU


@pytest.mark.unit
def test_more_ranks_than_gpus_is_refused_naming_both_numbers(monkeypatch) -> None:
    """``--nproc 2 --device cuda`` on a one-GPU machine: refused before any rank starts (not
    rank 1's "invalid device ordinal"), explicit or by default; the same check on a torchrun rank."""
    import argparse

    from moeflow.cli.errors import UsageError
    from moeflow.cli.train import _device
    from moeflow.parallel.launch.torchrun import TorchrunJob

    _fake_cuda(monkeypatch, 1)
    for given in ("cuda", None):
        args = argparse.Namespace(device=given, nproc=2)
        with pytest.raises(UsageError, match=r"--nproc 2 runs 2 ranks on this machine, one GPU each with --device "
                                             r"cuda.*but it has 1 CUDA device\(s\).*or give --device cpu"):
            _device(args, None)
    assert _device(argparse.Namespace(device="cpu", nproc=2), None).device == "cpu"
    assert _device(argparse.Namespace(device=None, nproc=1), None).device == "cuda"
    job = TorchrunJob(rank=1, world=2, local_rank=1, local_world=2, restart_count=0, run_id="x")
    with pytest.raises(UsageError, match=r"torchrun --nproc-per-node 2 \(LOCAL_WORLD_SIZE\) runs 2 ranks.*has 1 CUDA"):
        _device(argparse.Namespace(device=None, nproc=None), job)
    _fake_cuda(monkeypatch, 2)
    assert _device(argparse.Namespace(device="cuda", nproc=None), job).device == "cuda:1"


@pytest.mark.e2e
def test_train_refuses_more_ranks_than_gpus_before_starting_torchrun(tmp_path, monkeypatch, capsys) -> None:
    """One line, status 2, no rank started and nothing written, on a (faked) one-GPU machine."""
    import moeflow.parallel.launch.torchrun as launch

    _fake_cuda(monkeypatch, 1)
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("torchrun started"))
    for device in (["--device", "cuda"], []):
        assert main(["train", "--out", str(tmp_path / "run"), "--nproc", "2", "--steps", "1", *device]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith("moeflow train: error: --nproc 2 runs 2 ranks") and "1 CUDA device(s)" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_train_prints_its_device_first(tmp_path, capsys) -> None:
    assert main(["train", "--out", str(tmp_path / "run"), "--device", "cpu", "--steps", "1", "--batch-size", "2",
                 "--seq-len", "8", "--eval-batches", "1", "--no-progress", "--no-plot", "--sample-tokens", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "device: cpu (--device cpu)"
