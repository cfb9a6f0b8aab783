"""The training report as one PNG: loss curves; the learning-rate schedule, the routers' balance
(aux) loss and the throughput; and the expert load of every MoE layer over time (legend:
moeflow.types, plus ``N`` log points and ``L`` MoE layers)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_training", "training_figure"]


def plot_training(history: dict, path: str | Path, *, metrics: list[dict] | None = None,
                  title: str = "moeflow MoE GPT: loss", loss_label: str = "cross-entropy (nats/token)") -> Path:
    """``training_figure`` saved to ``path`` (a PNG)."""
    fig = training_figure(history, metrics=metrics, title=title, loss_label=loss_label)  # says what to install
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def training_figure(history: dict, *, metrics: list[dict] | None = None,  # type: ignore[no-untyped-def]
                    title: str = "moeflow MoE GPT: loss", loss_label: str = "cross-entropy (nats/token)"):
    """The report as a matplotlib figure. Top: training loss per step and validation loss.
    Middle: the learning rate per step (``history["lr"]``), and from ``metrics`` (``metrics.jsonl``'s records,
    ``moeflow.train.metrics``) the aux loss and tokens/s per step. Below: one heat map per MoE
    layer, experts on the y axis, steps on the x axis, colour = share of that layer's
    assignments; the colour bar marks the even share 1/E (where every expert would sit when
    perfectly balanced). Step axes have integer ticks. Needs matplotlib (``moeflow[train]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install 'moeflow[train]'") from err
    import numpy as np

    load = history.get("load", [])
    steps_of = [r for r in (metrics or []) if "loss" in r]
    n_layers = len(load[0][1]) if load else 0
    cols = max(3, min(4, n_layers))
    rows = 2 + (n_layers + cols - 1) // cols
    fig = plt.figure(figsize=(4 * cols + 1, 3.2 * rows), constrained_layout=True)
    grid = fig.add_gridspec(rows, cols)

    def integer_steps(a) -> None:  # type: ignore[no-untyped-def]
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_xlabel("step")
        a.grid(alpha=0.3)

    ax = fig.add_subplot(grid[0, :])
    ax.plot(history["step"], history["train_loss"], lw=0.8, alpha=0.7, label="train")
    if history.get("val"):
        vs, vl = zip(*history["val"])
        ax.plot(vs, vl, "o-", label=history.get("val_label", "validation (held-out works)"))
    integer_steps(ax)
    ax.set_ylabel(loss_label)
    ax.set_title(title)
    ax.legend()
    panels = [("learning rate", history["step"], history.get("lr", []), "lr"),
              ("routers' balance (aux) loss", [r["step"] for r in steps_of], [r["aux_loss"] for r in steps_of],
               "aux loss"),
              ("throughput", [r["step"] for r in steps_of], [r["tokens_per_s"] for r in steps_of], "tokens/s")]
    for j, (panel, xs, ys, label) in enumerate(panels):
        a = fig.add_subplot(grid[1, j])
        if len(xs) == len(ys) and xs:
            a.plot(xs, ys, lw=1.0)
        else:
            a.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=a.transAxes)
        integer_steps(a)
        a.set_title(panel)
        a.set_ylabel(label)
    if load:
        steps = [s for s, _ in load]
        frac_NLE = np.array([f for _, f in load])  # [log points, layers, experts]
        E = frac_NLE.shape[2]
        for i in range(n_layers):
            a = fig.add_subplot(grid[2 + i // cols, i % cols])
            im = a.imshow(frac_NLE[:, i, :].T, aspect="auto", origin="lower", cmap="viridis", vmin=0,
                          vmax=max(2.0 / E, float(frac_NLE.max())),
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, E - 0.5))
            a.set_title(f"MoE layer {i}: expert load share")
            integer_steps(a)
            a.grid(False)
            a.set_ylabel("expert")
            a.yaxis.set_major_locator(MaxNLocator(integer=True))
            bar = fig.colorbar(im, ax=a, fraction=0.046)
            even, top = 1.0 / E, max(2.0 / E, float(frac_NLE.max()))
            bar.ax.axhline(even, color="white", lw=2)
            bar.ax.axhline(even, color="black", lw=0.8, ls="--")
            ticks = [t for t in bar.get_ticks() if 0 <= t <= top and abs(t - even) > 0.08 * top] + [even]
            bar.set_ticks(sorted(ticks))
            bar.set_ticklabels([f"1/E={even:.3g}" if t == even else f"{t:g}" for t in sorted(ticks)])
    return fig
