"""The vision MoE's training (``moeflow.train.vision``, ``moeflow train-vision``): its config
validates (no compute), a non-finite loss stops it, and a short run on scikit-learn's digits
learns them."""

from __future__ import annotations

import pytest

from moeflow.cli.main import main
from moeflow.train import vision
from moeflow.train.vision import VisionTrainConfig, train_vision


@pytest.mark.unit
def test_vision_train_config_rejects_unknown_router() -> None:
    with pytest.raises(ValueError, match="router kind"):
        VisionTrainConfig(router="dot")


@pytest.mark.unit
@pytest.mark.parametrize(("fields", "match"), [
    ({"lr": float("nan")}, "lr must be finite, got nan"),
    ({"lr": float("inf")}, "lr must be finite, got inf"),
    ({"weight_decay": float("nan")}, "weight_decay must be finite"),
    ({"capacity_factor": float("inf")}, "capacity_factor must be finite"),
    ({"seed": -1}, "seed must be >= 0, got -1"),
])
def test_vision_train_config_rejects_nonfinite_and_negative_values(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VisionTrainConfig(**fields)


@pytest.mark.e2e
def test_nonfinite_loss_stops_vision_training(capsys) -> None:
    """A learning rate that overflows the weights: the next step's loss is not finite and the run
    stops there, exit 1 with one line, instead of training on nan."""
    assert main(["train-vision", "--epochs", "1", "--lr", "1e30"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moeflow train-vision: error: training stopped in epoch 1: the loss is ")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.e2e
def test_vision_moe_learns_digits(monkeypatch) -> None:
    """``moeflow train-vision`` trains to > 60% held-out accuracy; the test reads the result dict
    the command gets from ``train_vision``, not the line it prints."""
    results = []

    def recording(cfg, **kw):  # type: ignore[no-untyped-def]
        results.append(train_vision(cfg, **kw))
        return results[-1]

    monkeypatch.setattr(vision, "train_vision", recording)  # the command imports it when it runs
    assert main(["train-vision", "--epochs", "8"]) == 0
    assert len(results) == 1 and results[0]["test_accuracy"] > 0.6


@pytest.mark.e2e
def test_vision_run_writes_checkpoint_history_and_plot(tmp_path, capsys) -> None:
    """``--out``: the final checkpoint loads into a fresh model with the test accuracy the run
    reported; history.json has a point per step and per epoch (test loss and accuracy, the load
    share of every MoE layer summing to 1); training.png is written; a second run into the same
    directory is refused without --overwrite."""
    import json

    from moeflow.checkpoint import load_checkpoint
    from moeflow.models import VisionMoE

    out = tmp_path / "vision"
    argv = ["train-vision", "--epochs", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    history = json.loads((out / "history.json").read_text())
    steps = history["step"][-1]
    assert history["step"] == list(range(1, steps + 1)) and len(history["lr"]) == steps
    assert [s for s, _ in history["val"]] == [0, steps // 2, steps]
    assert all(abs(sum(share) - 1) < 1e-6 for _, layers in history["load"] for share in layers)
    assert (out / "training.png").stat().st_size > 10_000
    cfg = VisionTrainConfig(epochs=2)
    model = VisionMoE(cfg.model_config())
    assert load_checkpoint(out / "checkpoints", model)["step"] == steps
    x_tr, y_tr, x_te, y_te = vision.load_digits(cfg.seed)
    assert vision.accuracy(model, x_te, y_te) == history["test_accuracy"][-1][1]
    assert f"test accuracy: {history['test_accuracy'][-1][1]:.4f}" in printed
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--epochs", "1", "--no-plot"]) == 0
    assert not (out / "training.png").exists() and json.loads((out / "history.json").read_text())["step"][-1] == steps // 2
