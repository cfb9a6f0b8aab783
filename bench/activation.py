"""Activation memory of the MoE layer, side by side (issue: activation memory).

    python -m bench.activation 2048 512 1024 8 2 [--deepspeed] [--repeats 5]

For one configuration (T, D, H, E, K; fp32, SwiGLU, cf=1, position drops), in one process and on
the same weights, for each implementation:

- ``saved MiB``: what autograd holds for backward at the end of forward (every tensor packed by
  ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters and the input
  excluded): the memory that grows with the number of layers;
- ``peak MiB``: the fwd+bwd peak of ``moeflow.bench.memory.peak_memory_bytes`` (tensor bytes,
  parameter gradients included), the figure ``moeflow bench`` reports;
- ``ms``: median fwd+bwd time, implementations interleaved.

Implementations: ``moeflow`` (the layer), ``recompute`` (the layer with ``expert_recompute``),
``autograd`` (the layer with its experts run through plain autograd, ``ffn_reference``: what the
layer did before ``moeflow.experts.lean``), ``floor`` (the experts alone on balanced
``[E, ceil(T*K/E), D]`` input) and, with ``--deepspeed``, DeepSpeed's ``MoE`` layer (top-k gating
with capacity, one-hot einsum dispatch, one ``nn.Module`` per expert) with the same router and
expert weights, on a single-rank gloo group.

``--accumulate`` measures a later micro-batch of gradient accumulation instead: every
parameter already has its ``.grad`` (zeroed, kept), so ``peak`` is what the fwd+bwd adds to it.
moeflow then adds its expert weight gradients into ``.grad`` (``moeflow.experts.weight_grads``);
``no-fusion`` is the same layer with an identity hook on its expert weights, which keeps
autograd's own accumulation (a new gradient, then ``+=``).

``--layers L`` (default 4; 0: off) also measures a stack of ``L`` such layers (each its own
weights, ``y = layer(y)``), fwd+bwd with and without expert recompute: what recompute saves is
per layer and adds up over a model's layers, while the parameter gradients it cannot save add
up too. Reported: peak and saved MiB, median ms, and the ratios recompute / default.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from moeflow.bench.memory import keep_freed_heap, peak_memory_bytes
from moeflow.config import MoEConfig
from moeflow.experts.lean import ffn_reference
from moeflow.layer.moe import MoE

__all__ = ["main", "measure", "measure_stack", "saved_bytes"]


def saved_bytes(fn: Callable[[], object], exclude: list[torch.Tensor]) -> int:
    """Bytes of the storages autograd saves while ``fn()`` runs its forward (each once), less
    those of ``exclude`` (parameters, inputs)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


class _AutogradExperts(nn.Module):
    """The layer's own expert weights through plain autograd (the reference FFN)."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.inner = experts
        self.num_experts = experts.num_experts

    def forward(self, x: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        offs = None if x.dim() == 3 else torch.cumsum(counts_E, 0)
        return ffn_reference(x, self.inner.w_in, self.inner.w_out, offs, activation=self.inner.config.activation)


def _deepspeed_layer(layer: MoE, D: int, H: int, E: int, K: int) -> nn.Module:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    import deepspeed  # optional baseline, imported only when asked for
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    deepspeed.init_distributed(dist_backend="gloo")

    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_in = nn.Linear(D, 2 * H, bias=False)
            self.w_out = nn.Linear(H, D, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.w_in(x).chunk(2, dim=-1)
            return self.w_out(nn.functional.silu(gate) * up)

    ds = DeepSpeedMoE(hidden_size=D, expert=SwiGLU(), num_experts=E, ep_size=1, k=K, capacity_factor=1.0,
                      eval_capacity_factor=1.0, min_capacity=0, drop_tokens=True, use_rts=False).train()
    with torch.no_grad():
        ds.deepspeed_moe.gate.wg.weight.copy_(layer.router.linear.weight)
        for e, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
            expert.w_in.weight.copy_(layer.experts.w_in[e].t())
            expert.w_out.weight.copy_(layer.experts.w_out[e].t())
    return ds


def _measure_runs(impls: dict[str, Callable[[bool], None]], exclude: list[torch.Tensor], zero: Callable[[], None],
                  repeats: int) -> dict:
    """``{name: {"saved_mb", "peak_mb", "ms"}}`` of each ``run(backward)`` in ``impls``: one
    warm-up, the saved bytes of a forward (``exclude``: parameters and inputs), the fwd+bwd peak,
    then ``repeats`` fwd+bwd timings with the runs interleaved (median). ``zero()`` drops the
    gradients before each measured run, so each starts from the same state."""
    out: dict[str, dict] = {}
    for name, run in impls.items():
        run(True)  # warm-up
        zero()
        out[name] = {"saved_mb": saved_bytes(functools.partial(run, False), exclude) / 2**20}
        zero()
        out[name]["peak_mb"] = peak_memory_bytes(functools.partial(run, True), torch.device("cpu")) / 2**20
        out[name]["times"] = []
    for _ in range(repeats):
        for name, run in impls.items():
            zero()
            t0 = time.perf_counter()
            run(True)
            out[name]["times"].append(time.perf_counter() - t0)
    for rec in out.values():
        rec["ms"] = statistics.median(rec.pop("times")) * 1e3
    return out


def measure(T: int, D: int, H: int, E: int, K: int, *, deepspeed: bool = False, repeats: int = 5,
            accumulate: bool = False) -> dict:
    """``{impl: {"saved_mb", "peak_mb", "ms"}}`` for one configuration (module docstring)."""
    torch.manual_seed(0)
    layer = MoE(config=MoEConfig(dim=D, hidden=H, num_experts=E, top_k=K, capacity_factor=1.0)).train()
    autograd_layer = MoE(config=layer.config, experts_module=_AutogradExperts(layer.experts)).train()
    autograd_layer.router = layer.router
    x, grad = torch.randn(T, D), torch.randn(T, D)
    C = math.ceil(T * K / E)
    x_floor, grad_floor, counts = torch.randn(E, C, D), torch.randn(E, C, D), torch.full((E,), C)
    modules: list[nn.Module] = [layer]

    def layer_pass(module: nn.Module, recompute: bool, hooks: bool = False) -> Callable[[bool], None]:
        def run(backward: bool) -> None:
            layer.experts.recompute = recompute
            handles = [w.register_hook(lambda g: g) for w in (layer.experts.w_in, layer.experts.w_out)] if hooks else []
            xx = x.detach().requires_grad_(True)
            y = module(xx)
            if backward:
                y.backward(grad)
            for h in handles:
                h.remove()
        return run

    def floor(backward: bool) -> None:
        layer.experts.recompute = False
        xx = x_floor.detach().requires_grad_(True)
        y = layer.experts(xx, counts)
        if backward:
            y.backward(grad_floor)

    impls: dict[str, Callable[[bool], None]] = {
        "moeflow": layer_pass(layer, False), "recompute": layer_pass(layer, True),
        "autograd": layer_pass(autograd_layer, False), "floor": floor,
    }
    if accumulate:
        impls["no-fusion"] = layer_pass(layer, False, hooks=True)
    if deepspeed:
        ds = _deepspeed_layer(layer, D, H, E, K)
        modules.append(ds)

        def ds_pass(backward: bool) -> None:
            xx = x.detach().requires_grad_(True)
            y = ds(xx.unsqueeze(0))[0]
            if backward:
                y.backward(grad.unsqueeze(0))
        impls["deepspeed"] = ds_pass

    def zero() -> None:
        for m in modules:
            m.zero_grad(set_to_none=not accumulate)

    exclude = [p for m in modules for p in m.parameters()] + [x, x_floor]
    return _measure_runs(impls, exclude, zero, repeats)


def measure_stack(T: int, D: int, H: int, E: int, K: int, *, layers: int = 4, repeats: int = 3,
                  accumulate: bool = False) -> dict:
    """``{"moeflow" | "recompute": {"saved_mb", "peak_mb", "ms"}}`` for ``layers`` MoE layers of
    one configuration in a row (module docstring); the two variants interleaved for ``ms``."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    torch.manual_seed(0)
    cfg = MoEConfig(dim=D, hidden=H, num_experts=E, top_k=K, capacity_factor=1.0)
    stack = nn.Sequential(*[MoE(config=cfg) for _ in range(layers)]).train()
    x, grad = torch.randn(T, D), torch.randn(T, D)

    def variant(recompute: bool) -> Callable[[bool], None]:
        def run(backward: bool) -> None:
            for layer in stack:
                layer.experts.recompute = recompute
            y = stack(x.detach().requires_grad_(True))
            if backward:
                y.backward(grad)
        return run

    impls = {"moeflow": variant(False), "recompute": variant(True)}
    exclude = list(stack.parameters()) + [x]
    return _measure_runs(impls, exclude, lambda: stack.zero_grad(set_to_none=not accumulate), repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("T", "D", "H", "E", "K"):
        p.add_argument(name, type=int)
    p.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's MoE layer (must be importable)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="also a stack of this many layers (0: no)")
    p.add_argument("--accumulate", action="store_true",
                   help="a later micro-batch of gradient accumulation: every .grad exists already")
    args = p.parse_args(argv)
    if args.layers < 0:
        p.error(f"--layers must be >= 0, got {args.layers}")
    torch.set_num_threads(args.threads)
    keep_freed_heap()
    res = measure(args.T, args.D, args.H, args.E, args.K, deepspeed=args.deepspeed, repeats=args.repeats,
                  accumulate=args.accumulate)
    floor = res["floor"]["peak_mb"]
    regime = "later micro-batch (.grad exists)" if args.accumulate else "fresh gradients"
    print(f"T={args.T} D={args.D} H={args.H} E={args.E} K={args.K} fp32 swiglu cf=1, {args.threads} threads, {regime}")
    print(f"{'impl':<11}{'saved MiB':>10}{'peak MiB':>10}{'x floor':>9}{'ms':>9}")
    for name, r in res.items():
        print(f"{name:<11}{r['saved_mb']:>10.1f}{r['peak_mb']:>10.1f}{r['peak_mb'] / floor:>9.2f}{r['ms']:>9.1f}")
    if args.layers:
        st = measure_stack(args.T, args.D, args.H, args.E, args.K, layers=args.layers, repeats=args.repeats,
                           accumulate=args.accumulate)
        base, rec = st["moeflow"], st["recompute"]
        print(f"stack of {args.layers} layers")
        print(f"{'impl':<11}{'saved MiB':>10}{'peak MiB':>10}{'ms':>9}")
        for name, r in st.items():
            print(f"{name:<11}{r['saved_mb']:>10.1f}{r['peak_mb']:>10.1f}{r['ms']:>9.1f}")
        print(f"recompute / default: peak {rec['peak_mb'] / base['peak_mb']:.2f}, "
              f"saved {rec['saved_mb'] / base['saved_mb']:.2f}, time {rec['ms'] / base['ms']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
