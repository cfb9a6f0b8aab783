"""Helpers shared by the test modules (imported as a plain module: tests/ is on sys.path)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

import moeflow
from conftest import randomize_


def make_layer(
    gen: torch.Generator,
    *,
    dim: int = 8,
    hidden: int = 8,
    num_experts: int = 6,
    top_k: int = 2,
    dtype: torch.dtype = torch.float64,
    std: float = 0.5,
    router: moeflow.RouterConfig | None = None,
    dispatch: moeflow.DispatchConfig | None = None,
    experts_cfg: moeflow.ExpertsConfig | None = None,
    experts: nn.Module | None = None,
    eval_mode: bool = True,
    **fields: object,
) -> moeflow.MoE:
    """A small ``MoE`` with every parameter redrawn from N(0, std^2) (routing is non-trivial)."""
    kw: dict[str, object] = dict(fields)
    if router is not None:
        kw["router"] = router
    if dispatch is not None:
        kw["dispatch"] = dispatch
    if experts_cfg is not None:
        kw["experts"] = experts_cfg
    cfg = moeflow.MoEConfig(dim=dim, hidden=hidden, num_experts=num_experts, top_k=top_k, **kw)  # type: ignore[arg-type]
    layer = moeflow.MoE(config=cfg, experts_module=experts, dtype=dtype)
    randomize_(layer, gen, std=std)
    layer.train(not eval_mode)
    return layer


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


def output_and_grads(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    grad_out: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``y = fn(x)`` and the gradients of ``<y, grad_out>`` w.r.t. ``x`` and ``params``.

    Parameters that do not influence ``y`` get an exact zero gradient (not ``None``) so two
    implementations can be compared entry by entry.
    """
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    inputs = [x, *params]
    grads = torch.autograd.grad((y * grad_out).sum(), inputs, allow_unused=True)
    return y.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(inputs, grads)]


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Max abs error relative to the largest magnitude of ``expected`` (norm-wise, not per entry)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    scale = max(expected.abs().max().item(), 1e-300) if expected.numel() else 1.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= tol * max(scale, 1.0), f"{what}: max abs err {err:.3e} (scale {scale:.3e}, tol {tol:.1e})"


def compare_layer_with(
    layer: moeflow.MoE,
    reference: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    gen: torch.Generator,
    *,
    tol: float = 1e-10,
    call: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Outputs and the gradients of x and every parameter of ``layer`` agree with ``reference``."""
    names, params = zip(*layer.named_parameters())
    grad_out = rand(gen, *x.shape, dtype=x.dtype)
    y, grads = output_and_grads(call or layer, x, params, grad_out)
    y_ref, grads_ref = output_and_grads(reference, x, params, grad_out)
    assert_close_rel(y, y_ref, tol, "output")
    for name, g, g_ref in zip(("x", *names), grads, grads_ref):
        assert_close_rel(g, g_ref, tol, f"grad of {name}")
