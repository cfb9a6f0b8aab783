"""Train the vision MoE on scikit-learn's handwritten digits (1,797 real 8x8 scans, 10 classes).

A fixed stratified 75/25 split (by ``seed``) keeps the test images out of training; the report
is the test accuracy. Legend: ``B`` images, ``Q`` classes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import moeflow
from moeflow.checks import _float
from moeflow.config import DispatchConfig, RouterConfig, _int
from moeflow.models import VisionMoE, ViTMoEConfig
from moeflow.train.nonfinite import NonFiniteLossError, step_is_finite

__all__ = ["VisionTrainConfig", "train_vision", "load_digits"]


@dataclass(frozen=True, kw_only=True)
class VisionTrainConfig:
    """A digits training run. ``router`` is ``"linear"`` or ``"cosine"`` (SwinV2-MoE). A step
    whose loss or gradient is not finite stops the run (``NonFiniteLossError``, before the
    optimizer step: the weights stay finite)."""

    epochs: int = 15
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    router: str = "linear"
    drop_policy: str = "position"
    dim: int = 64
    depth: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "num_experts", "top_k", "dim", "depth"):
            _int(name, getattr(self, name), minimum=1)
        _int("seed", self.seed, minimum=0)
        for name in ("lr", "weight_decay", "capacity_factor"):
            _float(name, getattr(self, name))  # nan passes no comparison
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")
        self.model_config()

    def model_config(self) -> ViTMoEConfig:
        return ViTMoEConfig(
            image_size=8, patch_size=2, in_channels=1, num_classes=10, dim=self.dim, depth=self.depth,
            heads=4, mlp_hidden=2 * self.dim, moe_every=2, num_experts=self.num_experts, top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            router=RouterConfig(kind=self.router, cosine_proj_dim=32),  # type: ignore[arg-type]
            dispatch=DispatchConfig(drop_policy=self.drop_policy),  # type: ignore[arg-type]
        )


def load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train [B,1,8,8], y_train [B], x_test, y_test)``, pixels scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_digits
        from sklearn.model_selection import train_test_split
    except ImportError as err:
        raise ImportError("the digits data set needs scikit-learn: pip install 'moeflow[train]'") from err
    data = sk_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    i_train, i_test = train_test_split(range(len(y)), test_size=0.25, stratify=data.target, random_state=seed)
    return x[i_train], y[i_train], x[i_test], y[i_test]


@torch.no_grad()
def accuracy(model: VisionMoE, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = torch.cat([model(x[i : i + 256]).argmax(-1) for i in range(0, len(x), 256)])
    model.train()
    return float((pred == y).float().mean())


def train_vision(cfg: VisionTrainConfig, *, log=print) -> dict:  # type: ignore[no-untyped-def]
    """Train and return ``{"test_accuracy_before", "test_accuracy", "train_loss": [...], ...}``."""
    torch.manual_seed(cfg.seed)
    x_tr, y_tr, x_te, y_te = load_digits(cfg.seed)
    model = VisionMoE(cfg.model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = (len(y_tr) + cfg.batch_size - 1) // cfg.batch_size
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch)
    before = accuracy(model, x_te, y_te)
    losses = []
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(y_tr), generator=gen)
        total = 0.0
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            (loss + moeflow.aux_loss(model)).backward()
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.double().norm() for p in model.parameters() if p.grad is not None]))
            if not step_is_finite(loss.item(), float(grad_norm)):
                raise NonFiniteLossError(f"training stopped in epoch {epoch + 1}: the loss is {loss.item()} and the "
                                         f"gradient norm {float(grad_norm)}; the weights were not updated (lower --lr)")
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            total += loss.item() * len(idx)
        losses.append(total / len(y_tr))
        log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {losses[-1]:.4f}")
    return {"test_accuracy_before": before, "test_accuracy": accuracy(model, x_te, y_te), "train_loss": losses,
            "seconds": time.perf_counter() - t0, "train_images": len(y_tr), "test_images": len(y_te)}
