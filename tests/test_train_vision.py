"""The vision MoE's training (``moeflow.train.vision``, ``moeflow train-vision``): its config
validates (no compute), and a short run on scikit-learn's digits learns them."""

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
