"""Stage hf-layer: the whole ``moeflow.MoE`` layer against transformers' ``grouped_mm`` experts
on the same weights (``bench.hf.make_block``; the layer built from the block's tensors with the
same routing), forward and forward+backward at Mixtral-like, DeepSeek-like (with its shared
expert) and T=2048 shapes, for moeflow's default backend (``"auto"``), ``"grouped_mm"`` and
``"triton"``, and, where the ``scattermoe`` package is importable (CUDA), the layer with
ScatterMoE's Triton experts on the same weights and routing: ms, the ratio to transformers and
the output's relative error against it. ``worker_hf`` is the in-process part (``--worker hf``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

from bench.gpu_check.runner import NO_CUDA, Context, StageFailed, run_worker

__all__ = ["stage_hf_layer", "worker_hf", "moe_from_hf_block", "scattermoe_from_layer", "HF_SHAPES",
           "HF_TINY_SHAPES", "HF_MAX_REL_ERR"]


def stage_hf_layer(ctx: Context, timeout_s: float) -> dict:
    result = run_worker(ctx, "hf-layer", "hf", timeout_s)
    ctx.printed.append(result["table"])
    bad = [f"{r['shape']} {impl}: {m['rel_err']:.1e}" for r in result["rows"] for impl, m in r["impl"].items()
           if m.get("rel_err") is not None and not m["rel_err"] <= result["max_rel_err"]]
    parts = []
    for r in result["rows"]:
        ratios = ", ".join(f"{impl} {m['fwd_bwd_ms']:.1f} ms ({m['hf_over_this']:.2f}x)"
                           for impl, m in r["impl"].items() if impl != "transformers grouped_mm")
        hf_ms = r["impl"]["transformers grouped_mm"]["fwd_bwd_ms"]
        parts.append(f"{r['shape']}: transformers {hf_ms:.1f} ms, {ratios}")
    figures = {k: v for k, v in result.items() if k != "table"}
    if bad:
        raise StageFailed(f"outputs differ from transformers' (relative error over {result['max_rel_err']}): "
                          + "; ".join(bad))
    return {**figures, "summary": "fwd+bwd ms (transformers / moeflow): " + " | ".join(parts)}


def moe_from_hf_block(block, kind: str, backend: str):  # type: ignore[no-untyped-def]
    """A ``moeflow.MoE`` computing what the HF ``block`` (``bench.hf.make_block``) computes,
    with copies of its tensors: Mixtral (softmax top-2, renormalised; router logits in the model
    dtype, as transformers computes them) or DeepSeek-V3 (sigmoid, group-limited top-6 with the
    score-correction bias as the selection bias, routed scaling, one shared expert). No balance
    loss (the HF block computes none)."""
    import torch

    import moeflow
    from moeflow import ExpertsConfig, MoEConfig, RouterConfig

    experts = block.experts
    w = experts.gate_up_proj  # [E, 2H, D]
    E, D, h = w.shape[0], w.shape[2], w.shape[1] // 2
    kw = dict(device=w.device, dtype=w.dtype)
    if kind == "mixtral":
        router = RouterConfig(scoring="topk_softmax", load_balance_coef=0.0, dtype=w.dtype)
        top_k = getattr(block, "top_k", None) or block.gate.top_k
        cfg = MoEConfig(dim=D, hidden=h, num_experts=E, top_k=top_k, capacity_factor=0.0, router=router,
                        experts=ExpertsConfig(backend=backend, activation="swiglu"))
    else:
        hf_cfg = block.config
        router = RouterConfig(scoring="sigmoid", normalize_topk=bool(hf_cfg.norm_topk_prob),
                              routed_scaling_factor=float(hf_cfg.routed_scaling_factor), num_groups=hf_cfg.n_group,
                              topk_groups=hf_cfg.topk_group, group_score="top2_sum", load_balance_coef=0.0,
                              bias_update_rate=1e-3)  # (> 0: the bias is used for selection; no update is called)
        shared_h = block.shared_experts.gate_proj.weight.shape[0]
        cfg = MoEConfig(dim=D, hidden=h, num_experts=E, top_k=hf_cfg.num_experts_per_tok, capacity_factor=0.0,
                        router=router, experts=ExpertsConfig(backend=backend, activation="swiglu"),
                        num_shared_experts=1, shared_hidden=shared_h)
    layer = moeflow.MoE(config=cfg, **kw)
    with torch.no_grad():
        layer.router.linear.weight.copy_(block.gate.weight)
        layer.experts.w_in.copy_(experts.gate_up_proj.transpose(1, 2))  # [E, D, 2H]: gate columns, then up
        layer.experts.w_out.copy_(experts.down_proj.transpose(1, 2))  # [E, H, D]
        if kind != "mixtral":
            layer.router.expert_bias.copy_(block.gate.e_score_correction_bias)
            s = block.shared_experts
            layer.shared.proj_in.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            layer.shared.proj_out.weight.copy_(s.down_proj.weight)
    return layer


def scattermoe_from_layer(layer):  # type: ignore[no-untyped-def]
    """ScatterMoE's ``GLUMLP`` (``scattermoe.mlp``, Triton) holding copies of the moeflow layer's
    expert weights, and a forward ``x -> y`` that routes with the layer's router (the same
    routing as the layer's rows) and adds the layer's shared expert: the whole layer with
    ScatterMoE's experts, a peer of the same weights. Its ``experts`` weight is ``[E, 2H, D]``
    with the multiplied half first and the activated (gate) half second; moeflow's ``w_in`` is
    ``[E, D, 2H]``, gate columns first."""
    import torch
    from scattermoe.mlp import GLUMLP

    E, D, h2 = layer.experts.w_in.shape
    h = h2 // 2
    w = layer.experts.w_in
    smoe = GLUMLP(D, h, E, layer.config.top_k, activation=torch.nn.SiLU()).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        w_in = w.transpose(1, 2)  # [E, 2H, D]: gate rows, then up rows
        smoe.experts.weight.copy_(torch.cat([w_in[:, h:], w_in[:, :h]], dim=1))
        smoe.output_experts.weight.copy_(layer.experts.w_out.transpose(1, 2))  # [E, D, H]

    def forward(x):  # type: ignore[no-untyped-def]
        x_TD = x.reshape(-1, D)
        routing = layer.router(x_TD, top_k=layer.config.top_k)
        y_TD = smoe(x_TD, routing.weights_TK.to(x.dtype), routing.ids_TK)
        if layer.shared is not None:
            y_TD = y_TD + layer.shared(x_TD)
        return y_TD.view(x.shape)

    params = [*smoe.parameters(), *layer.router.parameters(), *(layer.shared.parameters() if layer.shared else [])]
    return forward, params


# (kind, T, D, H): Mixtral-like, the same block at T=2048, DeepSeek-like (H: the routed experts' hidden)
HF_SHAPES = [("mixtral", 16384, 4096, 14336), ("mixtral", 2048, 4096, 14336), ("deepseek_v3", 16384, 2048, 1408)]
HF_TINY_SHAPES = [("mixtral", 64, 32, 64), ("mixtral", 16, 32, 64), ("deepseek_v3", 64, 32, 16)]
HF_MAX_REL_ERR = 0.05  # the same model: bf16 rounding only (a routing flip on a near-tie moves a few tokens)


def worker_hf(args: argparse.Namespace) -> dict:
    """Stage hf-layer: every shape, transformers' grouped_mm block vs the moeflow layer."""
    import torch

    from bench import hf
    from moeflow.kernels.grouped_mm import resolve_grouped_mm_backend

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    warmup, repeats = (0, args.repeats or 1) if args.tiny else (2, args.repeats or 5)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)  # noqa: E731
    rows = []
    blocks: dict[tuple, object] = {}
    # ScatterMoE (not on PyPI: a checkout or wheel of github.com/shawntan/scattermoe carried to
    # the machine) runs Triton kernels: on CUDA only here (under the interpreter on CPU it takes
    # seconds a call; checked that way once, its output 1.6e-7 from transformers' in fp32)
    scattermoe_runs = importlib.util.find_spec("scattermoe") is not None and device.type == "cuda"
    for kind, T, D, H in HF_TINY_SHAPES if args.tiny else HF_SHAPES:
        key = (kind, D, H)
        if key not in blocks:  # the T=2048 row reuses the Mixtral-like block
            blocks.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch.manual_seed(0)
            with torch.device(device):
                container, _, _, _ = hf.make_block(kind, argparse.Namespace(
                    dim=D, hidden=H if kind == "mixtral" else 4 * H))
            block = container["mlp"].to(dtype)
            block.experts.config._experts_implementation = "grouped_mm"
            blocks[key] = (block, moe_from_hf_block(block, kind, "auto"))
        block, layer = blocks[key]
        block.train()
        layer.train()
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(1, T, D, device=device, dtype=dtype, generator=gen)
        g = torch.randn(1, T, D, device=device, dtype=dtype, generator=gen)
        xg = x.detach().clone().requires_grad_(True)
        backends = {"moeflow auto": "auto", "moeflow grouped_mm": "grouped_mm", "moeflow triton": "triton"}
        if device.type == "cpu":  # (the interpreter takes seconds a call; the kernels stage runs it)
            del backends["moeflow triton"]
        configs = {name: dataclasses.replace(layer.experts.config, backend=b) for name, b in backends.items()}
        peers = {}
        if scattermoe_runs:  # ScatterMoE's experts in the same layer: the peer issue 30 names
            layer.experts.config = configs["moeflow grouped_mm"]
            peers["scattermoe"] = scattermoe_from_layer(layer)

        def call(name: str, inp):  # type: ignore[no-untyped-def]
            if name == "transformers grouped_mm":
                return block(inp)
            if name in peers:
                return peers[name][0](inp)
            layer.experts.config = configs[name]  # the same layer (same weights), another experts backend
            return layer(inp)

        names = ["transformers grouped_mm", *backends, *peers]
        params = {n: [xg, *(block if n.startswith("transformers") else layer).parameters()] for n in names}
        params.update({n: [xg, *peer_params] for n, (_, peer_params) in peers.items()})

        def fwd(name: str) -> None:
            with torch.no_grad():
                call(name, x)
            sync()

        def fwd_bwd(name: str) -> None:
            torch.autograd.grad(call(name, xg), params[name], g, allow_unused=True)
            sync()

        row = {"shape": f"{kind} T={T} D={D} H={H} E={layer.config.num_experts} K={layer.config.top_k}",
               "auto_backend": resolve_grouped_mm_backend("auto", device, dtype, (D, 2 * H, H)), "impl": {}}
        with torch.no_grad():
            ref = call("transformers grouped_mm", x).float()
            errs = {n: float((call(n, x).float() - ref).norm() / ref.norm()) for n in [*backends, *peers]}
        f_ms = hf.interleaved_times_ms({n: (lambda n=n: fwd(n)) for n in names}, warmup, repeats)
        fb_ms = hf.interleaved_times_ms({n: (lambda n=n: fwd_bwd(n)) for n in names}, warmup, repeats)
        hf_fb = fb_ms[names[0]][0]
        for n in names:
            row["impl"][n] = {"fwd_ms": f_ms[n][0], "fwd_bwd_ms": fb_ms[n][0], "fwd_bwd_min_ms": fb_ms[n][1],
                              "hf_over_this": hf_fb / fb_ms[n][0], "rel_err": errs.get(n)}
        rows.append(row)
        del x, g, xg
    lines = [f"moeflow layer vs transformers grouped_mm experts, same weights ({dtype}, median of {repeats}; "
             "x = transformers ms / this ms, > 1 is faster than transformers)",
             f"{'shape':<42} {'impl':<24} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x':>6} {'rel err':>8}"]
    for r in rows:
        for n, m in r["impl"].items():
            err = "" if m["rel_err"] is None else f"{m['rel_err']:.1e}"
            lines.append(f"{r['shape']:<42} {n:<24} {m['fwd_ms']:>9.2f} {m['fwd_bwd_ms']:>11.2f} "
                         f"{m['hf_over_this']:>6.2f} {err:>8}")
    not_run = {} if device.type == "cuda" else {
        "moeflow triton": f"{NO_CUDA}: the Triton interpreter takes seconds a call (the kernels stage runs it)"}
    if not scattermoe_runs:
        not_run["scattermoe"] = ("not installed (github.com/shawntan/scattermoe; not on PyPI)"
                                 if importlib.util.find_spec("scattermoe") is None else NO_CUDA)
    return {"rows": rows, "dtype": str(dtype), "warmup": warmup, "repeats": repeats, "max_rel_err": HF_MAX_REL_ERR,
            "not_run": not_run, "table": "\n".join(lines)}
