"""The training report as one PNG: loss curves and the expert load of every MoE layer over time
(legend: moeflow.types, plus ``N`` log points and ``L`` MoE layers)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_training"]


def plot_training(history: dict, path: str | Path) -> Path:
    """Top: training loss per step and validation loss. Below: one heat map per MoE layer,
    experts on the y axis, steps on the x axis, colour = share of that layer's assignments
    (1/E everywhere means perfectly balanced). Needs matplotlib (``moeflow[train]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'moeflow[train]'") from err
    import numpy as np

    path = Path(path)
    load = history.get("load", [])
    n_layers = len(load[0][1]) if load else 0
    cols = max(1, min(4, n_layers))
    rows = 1 + (n_layers + cols - 1) // cols
    fig = plt.figure(figsize=(4 * cols + 1, 3.2 * rows), constrained_layout=True)
    grid = fig.add_gridspec(rows, cols)
    ax = fig.add_subplot(grid[0, :])
    ax.plot(history["step"], history["train_loss"], lw=0.8, alpha=0.7, label="train")
    if history.get("val"):
        vs, vl = zip(*history["val"])
        ax.plot(vs, vl, "o-", label="validation (held-out works)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("moeflow MoE GPT: loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if load:
        steps = [s for s, _ in load]
        frac_NLE = np.array([f for _, f in load])  # [log points, layers, experts]
        E = frac_NLE.shape[2]
        for i in range(n_layers):
            a = fig.add_subplot(grid[1 + i // cols, i % cols])
            im = a.imshow(frac_NLE[:, i, :].T, aspect="auto", origin="lower", cmap="viridis", vmin=0,
                          vmax=max(2.0 / E, float(frac_NLE.max())),
                          extent=(steps[0], steps[-1], -0.5, E - 0.5))
            a.set_title(f"MoE layer {i}: expert load share")
            a.set_xlabel("step")
            a.set_ylabel("expert")
            fig.colorbar(im, ax=a, fraction=0.046)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
