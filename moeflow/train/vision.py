"""Train the vision MoE on scikit-learn's handwritten digits (1,797 real 8x8 scans, 10 classes).

A fixed stratified 75/25 split (by ``seed``) keeps the test images out of training; the report
is the test accuracy. With ``out_dir`` the run also writes ``checkpoints/step-N`` (the model and
optimizer, ``moeflow.checkpoint``'s format, after the last epoch), ``history.json`` (per step:
loss, learning rate, aux loss and patch tokens/s; per epoch: test loss and accuracy and every
MoE layer's expert load) and ``training.png`` (``moeflow.train.plots``). ``progress`` shows a bar over the steps on a
terminal (per-epoch lines otherwise). Legend: ``B`` images, ``Q`` classes, ``L`` MoE layers.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
    out_dir: Path | None = None
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "num_experts", "top_k", "dim", "depth"):
            _int(name, getattr(self, name), minimum=1)
        _int("seed", self.seed, minimum=0)
        if self.out_dir is not None:
            object.__setattr__(self, "out_dir", Path(self.out_dir))
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
    x = torch.tensor(data.images, dtype=torch.float32, device="cpu").unsqueeze(1) / 16.0  # the CPU trainer's data
    y = torch.tensor(data.target, dtype=torch.int64, device="cpu")
    i_train, i_test = train_test_split(range(len(y)), test_size=0.25, stratify=data.target, random_state=seed)
    return x[i_train], y[i_train], x[i_test], y[i_test]


def evaluate(model: VisionMoE, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of ``model`` on ``x [B,1,8,8]``, ``y [B]``."""
    with torch.no_grad():
        model.eval()
        logits_BQ = torch.cat([model(x[i : i + 256]) for i in range(0, len(x), 256)])
        model.train()
        return float((logits_BQ.argmax(-1) == y).float().mean()), float(F.cross_entropy(logits_BQ, y))


def accuracy(model: VisionMoE, x: torch.Tensor, y: torch.Tensor) -> float:
    return evaluate(model, x, y)[0]


def _bar(cfg: VisionTrainConfig, total: int):  # type: ignore[no-untyped-def]
    """A tqdm bar over the steps on a terminal with ``progress``; None otherwise (or without tqdm)."""
    if not cfg.progress or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="train-vision", unit="step", leave=False)


def train_vision(cfg: VisionTrainConfig, *, log=print) -> dict:  # type: ignore[no-untyped-def]
    """Train and return ``{"test_accuracy_before", "test_accuracy", "train_loss": [...], ...}``
    (``"checkpoint"`` and ``"plot"``: the paths written with ``out_dir``)."""
    torch.manual_seed(cfg.seed)
    x_tr, y_tr, x_te, y_te = load_digits(cfg.seed)
    model = VisionMoE(cfg.model_config())
    layers = moeflow.moe_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = (len(y_tr) + cfg.batch_size - 1) // cfg.batch_size
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch)
    before, before_loss = evaluate(model, x_te, y_te)
    history: dict = {"step": [], "train_loss": [], "lr": [], "val": [[0, before_loss]], "test_accuracy": [[0, before]],
                     "load": [], "val_label": "test (held-out digits)"}
    losses = []
    metrics: list[dict] = []  # per step, as moeflow.train.plots reads them
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = _bar(cfg, cfg.epochs * steps_per_epoch)
    step = 0
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(y_tr), generator=gen, device="cpu")
        total = 0.0
        counts_LE = torch.zeros(len(layers), cfg.num_experts, dtype=torch.long, device="cpu")  # host-side record
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            t_step = time.perf_counter()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            step_counts_LE = torch.stack([layer.last_counts_E.cpu() for layer in layers])
            counts_LE += step_counts_LE
            aux = moeflow.aux_loss(model)
            (loss + aux).backward()
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.double().norm() for p in model.parameters() if p.grad is not None]))
            loss_value = loss.item()  # one read per step (the loss is logged four ways below)
            if not step_is_finite(loss_value, float(grad_norm)):
                raise NonFiniteLossError(f"training stopped in epoch {epoch + 1}: the loss is {loss_value} and the "
                                         f"gradient norm {float(grad_norm)}; the weights were not updated (lower --lr)")
            history["lr"].append(opt.param_groups[0]["lr"])
            opt.step()
            moeflow.zero_grad_(model)  # the experts' gradients kept and zeroed in place, the rest dropped
            sched.step()
            step += 1
            total += loss_value * len(idx)
            history["step"].append(step)
            history["train_loss"].append(loss_value)
            tokens = int(step_counts_LE[0].sum()) // cfg.top_k  # patch tokens the MoE layers routed
            metrics.append({"step": step, "loss": loss_value, "aux_loss": aux.item(),
                            "tokens_per_s": tokens / max(time.perf_counter() - t_step, 1e-9)})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss_value:.3f}")
        losses.append(total / len(y_tr))
        acc, test_loss = evaluate(model, x_te, y_te)
        history["val"].append([step, test_loss])
        history["test_accuracy"].append([step, acc])
        history["load"].append([step, (counts_LE / counts_LE.sum(1, keepdim=True).clamp(min=1)).tolist()])
        line = f"epoch {epoch + 1}/{cfg.epochs}: train loss {losses[-1]:.4f}, test accuracy {acc:.4f}"
        if bar is not None:
            bar.write(line)
        else:
            log(line)
    if bar is not None:
        bar.close()
    result = {"test_accuracy_before": before, "test_accuracy": history["test_accuracy"][-1][1], "train_loss": losses,
              "seconds": time.perf_counter() - t0, "train_images": len(y_tr), "test_images": len(y_te)}
    if cfg.out_dir is not None:
        result.update(_write_run(cfg, model, opt, step, history, metrics))
    return result


def _write_run(cfg: VisionTrainConfig, model: VisionMoE, opt: torch.optim.Optimizer, step: int,
               history: dict, metrics: list[dict]) -> dict:
    """The checkpoint, ``history.json`` and (with ``plot``) ``training.png`` under ``cfg.out_dir``."""
    from moeflow.checkpoint import save_checkpoint

    out = cfg.out_dir
    assert out is not None
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    ckpt = save_checkpoint(out / "checkpoints", step, model, opt,
                           extra={"family": "moeflow-vision-moe", "train": settings})
    (out / "history.json").write_text(json.dumps({**history, "metrics": metrics}))
    written = {"checkpoint": str(ckpt)}
    if cfg.plot:
        from moeflow.train.plots import plot_training

        written["plot"] = str(plot_training(history, out / "training.png", metrics=metrics,
                                            title="moeflow vision MoE: loss",
                                            loss_label="cross-entropy"))
    return written
