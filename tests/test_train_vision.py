"""The vision MoE's training (``moeflow.train.vision``, ``moeflow train-vision``): its config
validates (no compute), a non-finite loss stops it, and a short run on scikit-learn's digits
learns them."""

from __future__ import annotations

import pytest
import torch

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
    torch.set_num_threads(2)
    assert main(["train-vision", "--epochs", "1", "--lr", "1e30"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moeflow train-vision: error: training stopped in epoch 1: the loss is ")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.e2e
def test_vision_moe_learns_digits(monkeypatch) -> None:
    """``moeflow train-vision`` trains to > 60% held-out accuracy; the test reads the result dict
    the command gets from ``train_vision``, not the line it prints."""
    torch.set_num_threads(2)
    results = []

    def recording(cfg, **kw):  # type: ignore[no-untyped-def]
        results.append(train_vision(cfg, **kw))
        return results[-1]

    monkeypatch.setattr(vision, "train_vision", recording)  # the command imports it when it runs
    assert main(["train-vision", "--epochs", "8"]) == 0
    assert len(results) == 1 and results[0]["test_accuracy"] > 0.6
