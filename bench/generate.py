"""Text generation, moeflow vs transformers, on the same weights in one process.

A random Mixtral-shaped ``MoEGPT`` is exported with ``moeflow.convert.mixtral.gpt_to_hf`` (what
``moeflow convert --to-hf`` writes) and loaded into transformers' ``MixtralForCausalLM``. Both
generate greedily from the same prompts (batch ``B`` rows of ``--prompt-len`` random tokens,
``n`` new tokens, no stop token), for every ``B`` in ``--batch-sizes`` and ``n`` in
``--new-tokens``:

    moeflow          MoEGPT.generate's loop (``moeflow.models.generation.generate``: KV cache)
    moeflow:compiled the same with ``compile=True``: the static decode step compiled with
                     ``torch.compile(fullgraph=True)`` (CUDA graphs on CUDA; on the CPU its
                     experts multiply packed copies of their weights, ``moeflow.kernels.packed_cpu``,
                     where a C++ compiler builds the kernel: ``compiled_experts`` in the report)
                     (``--no-compiled``: left out)
    hf:<impl>        MixtralForCausalLM.generate (KV cache, eager) with each experts implementation
                     of ``--hf-experts`` (transformers' ``set_experts_implementation``: ``eager``
                     per-expert loop, ``grouped_mm``, ``batched_mm``)
    hf:static        transformers' own compiled decoding: a ``StaticCache`` and its
                     ``torch.compile`` of the forward (``CompileConfig``: CUDA graphs on CUDA,
                     plain inductor on CPU), ``grouped_mm`` experts; one cache per shape reused
                     across calls (``bench.generate_runs.HFStaticGenerate``: transformers'
                     ``cache_implementation="static"`` makes a new one per call, which CUDA graphs
                     record again) (``--hf-static``; on by default on CUDA)

Like is compared with like: the ratios (``ratios`` in the report, > 1: moeflow faster) are
moeflow's eager decode over transformers' fastest eager ``generate``, moeflow's compiled decode
over transformers' static-cache compiled ``generate``, and compiled over eager moeflow (what
compilation itself gains); a compiled decode against an eager Python loop is no comparison of
the libraries and is not reported. A ratio with a compiled side that compiled or recorded a CUDA
graph during its timed calls (``bench.common.CompileWatch``) is withdrawn (``withdrawn``: why).

Warm-up: the compiled candidates run until their decode time settles (two consecutive calls
within ``--settle``, at most ``--max-warmups`` calls), the eager ones once; what each compiled,
recorded and recompiled in its warm-up and in its timed calls is in its row. Prefill is the time
from the call to the first new token of every row (the prompt's forward and one pick), decode
the rest: for transformers, a streamer stamps the first new token. Tokens/s: prefill
``B * prompt_len / prefill_s``, decode ``B * (n - 1) / decode_s``. The candidates take turns
within each of ``--repeats`` rounds (fair under a fluctuating load); medians are reported.

Each case (``cases`` in the report) also holds (``bench.generate_checks``):

- ``fp32_tokens``: moeflow's compiled and eager greedy tokens of an fp32 copy of the model, which
  must be equal (``identical`` or the first differing step), at the batch sizes of
  ``--fp32-check-batches``. Lower precisions round differently in the two paths (fused and
  reordered sums), a near tie flips and the rows part: their tokens are not compared;
- ``first_step_logits``: the first decode step's logits (after the prompt and the fp32 model's
  first token) of moeflow eager, moeflow compiled and transformers in ``--dtype``, against the
  fp32 eager step's (max abs, max relative to the largest logit, top-1 agreement);
- ``limit``: the bytes a decode step must read (the routed experts the steps' tokens hit, counted
  on moeflow's eager run, plus every other weight, the embedding rows and the KV cache at the
  steps' mean length), the device's copy bandwidth (``bench.common.copy_bandwidth_gbps``) and
  the time that leaves for a step; each row's ``bandwidth_fraction`` is that time over its own
  step time (1: as fast as the memory allows).

``--device cuda --dtype bfloat16`` with the model flags of issue 27's GPU measurement (dim 1024,
8 layers, 16 heads, 8 KV heads, 8 experts, top-2, expert hidden 1408, vocabulary 32000,
128-token prompts, 128 new tokens, batch 1 and 16) is the GPU comparison ``bench.gpu_check``
runs; on CUDA every clock reading follows a device synchronisation.

    .venv/bin/python -m bench.generate            # writes bench/results/generate.json

``--layer-tokens``: the MoE layer of block 0 alone (no grad, the shape of a decode step: T
tokens of B rows) at T = 1, 8, 64: moeflow's layer, the loop reference
(``moeflow.testing.loop_moe`` after the same router), and transformers' ``MixtralSparseMoeBlock``
of the same block with each ``--hf-experts`` implementation; microseconds per call (median of
``--repeats`` rounds of ``--layer-calls`` calls) and the largest output difference from moeflow.

Weights: ``--init-std`` (0.05) gives logits sharp enough that fp32 rounding differences between
the two implementations do not flip a greedy pick.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from moeflow.kernels.packed_cpu import packed_cpu_available
from bench.common import RESULTS, CompileWatch, copy_bandwidth_gbps
from bench.generate_checks import (RouterHits, bandwidth_fraction, decode_step_bytes, first_step_logits,
                                   fp32_token_check, like_for_like_ratios, token_agreement)
from bench.generate_runs import CLOCKS, HFStaticGenerate, run_hf, run_moeflow, take_turns, warm_until_settled

_run_hf = run_hf  # (the names bench.generate_offload imports)
_first_difference = token_agreement
COMPILED = ("moeflow:compiled", "hf:static")  # the candidates warmed up until their time settles

__all__ = ["add_model_flags", "build_model", "load_hf", "main", "run_generate_bench", "take_turns", "write_report"]


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The random Mixtral-shaped model's flags (read by ``build_model``), shared with
    ``bench.generate_offload`` so that both benches build the same model."""
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2, help="the router's k")
    p.add_argument("--hidden", type=int, default=512, help="expert hidden size")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--init-std", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)


def build_model(args: argparse.Namespace, max_seq_len: int):  # type: ignore[no-untyped-def]
    """The ``MoEGPT`` of ``add_model_flags``' flags (seeded with ``--seed``, eval, fp32 on the
    CPU: the caller moves it), holding ``max_seq_len`` positions (the prompt and the new tokens)."""
    from moeflow.config import RouterConfig
    from moeflow.models import GPTConfig, MoEGPT

    cfg = GPTConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                    n_kv_heads=args.kv_heads, max_seq_len=max_seq_len, moe_every=1,
                    num_experts=args.experts, top_k=args.top_k, expert_hidden=args.hidden,
                    router=RouterConfig(scoring="topk_softmax"), init_std=args.init_std)
    torch.manual_seed(args.seed)
    return MoEGPT(cfg).eval()


def load_hf(hf_dir: Path, **from_pretrained):  # type: ignore[no-untyped-def]
    """transformers' ``MixtralForCausalLM`` from ``gpt_to_hf``'s export in ``hf_dir`` (sdpa
    attention, eval; ``from_pretrained``: more keywords, e.g. accelerate's ``device_map``),
    without a stop token, so that every row generates the tokens asked for."""
    import transformers

    hf = transformers.MixtralForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa",
                                                         **from_pretrained).eval()
    hf.generation_config.eos_token_id = None
    return hf


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", default="64,512")
    p.add_argument("--hf-experts", default="grouped_mm,eager,batched_mm",
                   help="transformers' experts implementations to time (comma-separated)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time, or this process's CPU time (steadier on a shared machine; use with --threads 1)")
    p.add_argument("--layer-tokens", default="1,8,64",
                   help="also time block 0's MoE layer alone at these token counts (empty: skip)")
    p.add_argument("--layer-calls", type=int, default=200, help="calls per timed repeat of the layer")
    p.add_argument("--skip-generate", action="store_true", help="only the layer timings")
    p.add_argument("--no-compiled", action="store_true", help="leave out moeflow:compiled")
    p.add_argument("--hf-static", choices=["auto", "on", "off"], default="auto",
                   help="transformers' static-cache compiled generate (hf:static; auto: on CUDA only, where "
                        "transformers compiles by itself; its compilation takes long on a CPU)")
    p.add_argument("--settle", type=float, default=0.05,
                   help="a compiled candidate's warm-up ends when two consecutive calls' decode times are this "
                        "close (relative; default 0.05)")
    p.add_argument("--max-warmups", type=int, default=8, help="most warm-up calls of a compiled candidate")
    p.add_argument("--fp32-check-batches", default=None,
                   help="batch sizes at which compiled and eager tokens of an fp32 copy are compared "
                        "(comma-separated; default: all of --batch-sizes; empty: none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the weights' and activations' dtype (default float32; bfloat16 on a GPU)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    return p


def build_models(args: argparse.Namespace, hf_dir: Path):  # type: ignore[no-untyped-def]
    """The moeflow model in ``--dtype``, transformers' model loaded from its export (both eval,
    on ``--device``) and an fp32 copy of the moeflow model (the same one in fp32)."""
    from moeflow.convert.mixtral import gpt_to_hf

    model = build_model(args, args.prompt_len + max(int(n) for n in args.new_tokens.split(",")))
    gpt_to_hf(model, hf_dir)
    dtype = getattr(torch, args.dtype)
    model32 = model.to(device=args.device)
    model = model32 if dtype == torch.float32 else copy.deepcopy(model32).to(dtype=dtype)
    return model, load_hf(hf_dir).to(device=args.device, dtype=dtype), model32


def run_generate_bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    impls = [s for s in args.hf_experts.split(",") if s]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    checked = batches if args.fp32_check_batches is None else [int(b) for b in args.fp32_check_batches.split(",") if b]
    clock = CLOCKS[args.clock]
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-generate-") as tmp:
        model, hf, model32 = build_models(args, Path(tmp) / "hf")
    gen = torch.Generator().manual_seed(args.seed + 1)
    layer_rows = _layer_bench(args, model, hf, impls, clock, gen) if args.layer_tokens else []
    static = args.hf_static == "on" or (args.hf_static == "auto" and device.type == "cuda")
    hf_static = HFStaticGenerate(hf) if static else None
    copy_gbps = None if args.skip_generate else copy_bandwidth_gbps(device)
    rows: list[dict] = []
    cases: list[dict] = []
    with torch.no_grad():
        for B in ([] if args.skip_generate else batches):
            idx = torch.randint(0, args.vocab, (B, args.prompt_len), generator=gen).to(args.device)
            for n in (int(v) for v in args.new_tokens.split(",")):
                case_rows, case = _run_case(args, (model, model32, hf, hf_static), impls, idx, n, clock, copy_gbps,
                                            fp32_check=B in checked)
                rows += case_rows
                cases.append(case)
                _print_case(case_rows, case)
    return {
        "bench": "generate", "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "clock": args.clock, "torch": torch.__version__, "dtype": args.dtype,
        "device": str(args.device) + (f" ({torch.cuda.get_device_name(args.device)})" if device.type == "cuda" else ""),
        "transformers": __import__("transformers").__version__, "args": {k: str(v) for k, v in vars(args).items()},
        "compiled_experts": ("packed few-row kernel (moeflow.kernels.packed_cpu)"
                             if torch.device(args.device).type == "cpu" and args.dtype == "float32"
                             and packed_cpu_available()
                             else "the weights themselves (grouped GEMM)"),
        "hf_static": (f"run: one StaticCache per shape reused ({hf_static.caches_made} made)" if hf_static else
                      "not run (--hf-static off, or auto on a CPU: transformers' inductor compilation takes long)"),
        "copy_gbps": copy_gbps, "results": rows, "cases": cases,
        "ratios": [r for case in cases for r in case["ratios"]], "layer": layer_rows,
    }


def _run_case(args: argparse.Namespace, models: tuple, impls: list[str], idx: torch.Tensor, n: int,
              clock: Callable[[], float], copy_gbps: float | None, fp32_check: bool) -> tuple[list[dict], dict]:
    """One batch size and length: the candidates warmed up and timed in turns, their rows, and
    the case's checks and limit (the module docstring)."""
    model, model32, hf, hf_static = models
    B, P = idx.shape
    cands = {"moeflow": lambda: run_moeflow(model, idx, n, clock)}
    if not args.no_compiled:
        cands["moeflow:compiled"] = lambda: run_moeflow(model, idx, n, clock, compile=True)
    for impl in impls:
        cands[f"hf:{impl}"] = lambda impl=impl: (hf.set_experts_implementation(impl), run_hf(hf, idx, n, clock))[1]
    if hf_static is not None:
        cands["hf:static"] = lambda: (hf.set_experts_implementation("grouped_mm"), hf_static(idx, n, clock))[1]
    warm: dict[str, dict] = {}
    hits = None
    for name, run in cands.items():
        with CompileWatch() as watch:
            if name in COMPILED:  # compiles, records CUDA graphs, then settles
                warm[name] = warm_until_settled(run, tol=args.settle, max_calls=args.max_warmups)
            elif name == "moeflow":  # a whole generation, counting the experts each decode step hits
                with RouterHits(model) as router:
                    run()
                hits, warm[name] = router.per_step() if n > 1 else None, {"calls": 1}
            else:
                hf.set_experts_implementation(name[3:])
                run_hf(hf, idx, min(n, 4), clock)
                warm[name] = {"calls": 1}
        warm[name]["compile"] = watch.as_dict()
    timed = {name: {"graphs": 0, "cuda_graphs": 0, "recompiles": []} for name in cands}

    def watched(name: str, run):  # type: ignore[no-untyped-def]
        def call():  # type: ignore[no-untyped-def]
            with CompileWatch() as w:
                out = run()
            for k, v in w.as_dict().items():
                timed[name][k] += v
            return out
        return call

    medians, tokens = take_turns({name: watched(name, run) for name, run in cands.items()}, args.repeats)
    limit = None
    if copy_gbps and n > 1:
        nbytes = decode_step_bytes(model, rows=B, cache_len=P + n / 2, experts_hit=hits)
        limit = {"bytes_per_step": nbytes, "experts_hit_per_step": hits, "cache_len": P + n / 2,
                 "copy_gbps": copy_gbps, "floor_step_ms": nbytes["total"] / (copy_gbps * 1e9) * 1e3}
    rows = []
    for name, (pre, dec) in medians.items():
        step_s = dec / (n - 1) if n > 1 and dec > 0 else None
        rows.append({
            "batch": B, "new_tokens": n, "candidate": name, "prefill_s": pre, "decode_s": dec,
            "prefill_tok_s": B * P / pre, "decode_tok_s": B * (n - 1) / dec if dec else None,
            "step_ms": step_s * 1e3 if step_s else None,
            "bandwidth_fraction": (bandwidth_fraction(limit["bytes_per_step"]["total"], copy_gbps, step_s)
                                   if limit and step_s else None),
            "tokens_vs_moeflow": token_agreement(tokens["moeflow"], tokens[name]),
            "warmup": warm[name], "timed_compile": timed[name],
        })
    if args.no_compiled or not fp32_check:
        fp32 = {"checked": False, "why": "--no-compiled" if args.no_compiled else "not at this batch size "
                                                                                   "(--fp32-check-batches)"}
    else:
        fp32 = fp32_token_check(model32, idx, n)
    if impls:
        hf.set_experts_implementation(impls[0])
    logits = first_step_logits(model, model32, idx, compiled_new_tokens=None if args.no_compiled else n,
                               hf=hf if impls else None)
    case = {"batch": B, "new_tokens": n, "dtype": args.dtype, "limit": limit, "fp32_tokens": fp32,
            "first_step_logits": logits, "ratios": like_for_like_ratios(rows)}
    return rows, case


def _layer_bench(args: argparse.Namespace, model, hf, impls: list[str], clock, gen: torch.Generator) -> list[dict]:  # type: ignore[no-untyped-def]
    """Block 0's MoE layer alone at each of ``--layer-tokens`` (see the module docstring)."""
    from moeflow.testing import loop_moe

    layer, block = model.layers[0].ffn, hf.model.layers[0].mlp

    def loop(x_TD: torch.Tensor) -> torch.Tensor:
        routing = layer.router(x_TD, top_k=layer.config.top_k)
        return loop_moe(layer, x_TD, routing=(routing.weights_TK, routing.ids_TK))

    def hf_block(impl: str):  # type: ignore[no-untyped-def]
        def call(x_TD: torch.Tensor) -> torch.Tensor:
            hf.set_experts_implementation(impl) if hf.config._experts_implementation != impl else None
            out = block(x_TD.unsqueeze(0))
            return (out[0] if isinstance(out, tuple) else out)[0]
        return call

    def moeflow(x_TD: torch.Tensor) -> torch.Tensor:  # as a decode step calls it: no balance losses
        return layer(x_TD, losses=False)

    cands = {"moeflow": moeflow, "loop": loop, **{f"hf:{i}": hf_block(i) for i in impls}}
    rows = []
    with torch.no_grad():
        for T in (int(t) for t in args.layer_tokens.split(",")):
            x_TD = torch.randn(T, args.dim, generator=gen).to(device=args.device, dtype=getattr(torch, args.dtype))
            ref = layer(x_TD)
            times: dict[str, list[float]] = {name: [] for name in cands}
            diffs = {name: float((fn(x_TD) - ref).abs().max()) for name, fn in cands.items()}
            for r in range(args.repeats):
                for name in (list(cands) if r % 2 == 0 else list(cands)[::-1]):
                    fn = cands[name]
                    fn(x_TD)
                    t0 = clock()
                    for _ in range(args.layer_calls):
                        fn(x_TD)
                    times[name].append((clock() - t0) / args.layer_calls * 1e6)
            print(f"MoE layer alone, T={T}")
            for name in cands:
                us = statistics.median(times[name])
                rows.append({"tokens": T, "candidate": name, "us": us, "max_abs_diff": diffs[name]})
                print(f"  {name:<16} {us:>9.1f} us   x{us / statistics.median(times['moeflow']):.2f} of moeflow's time"
                      f"   max |diff| {diffs[name]:.1e}", flush=True)
    return rows


def _print_case(rows: list[dict], case: dict) -> None:
    print(f"B={case['batch']} new={case['new_tokens']} ({case['dtype']})")
    for r in rows:
        frac = f"{r['bandwidth_fraction']:6.1%}" if r["bandwidth_fraction"] is not None else "     -"
        t = r["timed_compile"]
        print(f"  {r['candidate']:<16} prefill {r['prefill_tok_s']:>10,.0f} tok/s  decode "
              f"{r['decode_tok_s'] or 0:>9,.0f} tok/s  {r['step_ms'] or 0:8.3f} ms/step  {frac} of the bandwidth "
              f"limit   tokens {r['tokens_vs_moeflow']}"
              f"   warm-up {r['warmup']['calls']} calls; timed: {t['graphs']} compiled, {t['cuda_graphs']} recorded")
    limit = case["limit"]
    if limit:
        print(f"  limit: {limit['bytes_per_step']['total'] / 1e6:,.2f} MB a step "
              f"({sum(limit['experts_hit_per_step']):.1f} expert reads) at {limit['copy_gbps']:,.1f} GB/s copy "
              f"bandwidth: {limit['floor_step_ms']:.3f} ms a step")
    fp32 = case["fp32_tokens"]
    print("  fp32 compiled vs eager tokens: "
          + (fp32["agreement"] if fp32["checked"] else f"not checked ({fp32['why']})"))
    print(f"  first decode step's logits ({case['dtype']}) vs fp32 eager: " + ", ".join(
        f"{name} {d['max_abs']:.2e} abs, {d['max_rel']:.2e} rel, top-1 {d['top1_agree']:.0%}"
        for name, d in case["first_step_logits"].items()))
    for r in case["ratios"]:
        shown = (f"withdrawn: {r['withdrawn']}" if r["withdrawn"] else
                 f"decode {r['decode_x'] or 0:.2f}x, prefill {r['prefill_x']:.2f}x")
        print(f"  {r['pair']} ({r['candidate']} / {r['baseline']}): {shown}", flush=True)


def write_report(report: dict, path: Path | None) -> None:
    """Write a bench's ``report`` as JSON to ``path`` and say so (``None``: write nothing)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if not 0 < args.settle < 1:
        p.error(f"--settle must be in (0, 1), got {args.settle}")
    if args.max_warmups < 3:
        p.error(f"--max-warmups must be >= 3 (a compilation, then two calls to compare), got {args.max_warmups}")
    batches = args.batch_sizes.split(",")
    unknown = [b for b in (args.fp32_check_batches or "").split(",") if b and b not in batches]
    if unknown:
        p.error(f"--fp32-check-batches: {','.join(unknown)} not in --batch-sizes {args.batch_sizes}")
    if args.json is None:
        args.json = default_json
    write_report(run_generate_bench(args), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "generate.json"))
