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
                     where a C++ compiler builds the kernel: ``compiled_experts`` in the report);
                     compiled and warmed up before the clock starts (``--no-compiled``: left out)
    hf:<impl>        MixtralForCausalLM.generate (KV cache) with each experts implementation of
                     ``--hf-experts`` (transformers' ``set_experts_implementation``: ``eager``
                     per-expert loop, ``grouped_mm``, ``batched_mm``)
    hf:static        transformers' own compiled decoding: ``cache_implementation="static"`` with
                     its ``torch.compile`` of the forward (``CompileConfig``: CUDA graphs on CUDA,
                     plain inductor on CPU), ``grouped_mm`` experts (``--hf-static``; on by
                     default on CUDA, where transformers compiles a static cache by itself)

Every candidate runs once with the same shapes before the timed rounds (compilation and CUDA
graph recording stay out of the timings). ``--device cuda --dtype bfloat16`` with the model
flags of issue 27's GPU measurement (dim 1024, 8 layers, 16 heads, 8 KV heads, 8 experts,
top-2, expert hidden 1408, vocabulary 32000, 128-token prompts, 128 new tokens, batch 1 and
16) is the GPU comparison ``bench.gpu_check`` runs; on CUDA every clock reading follows a
device synchronisation.

Prefill is the time from the call to the first new token of every row (the prompt's forward
and one pick), decode the rest: for transformers, a streamer stamps the first new token
(``generate`` hands each step's tokens to it). Tokens/s: prefill ``B * prompt_len /
prefill_s``, decode ``B * (n - 1) / decode_s``. The candidates take turns within each of
``--repeats`` rounds (fair under a fluctuating load), medians are reported with the ratios
moeflow / best transformers implementation (> 1: moeflow faster), and the greedy tokens of
every candidate are compared with moeflow's (``identical`` or the first differing step).

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
import datetime
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeflow.kernels.packed_cpu import packed_cpu_available
from bench.common import RESULTS

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
                   help="transformers' static-cache compiled generate (hf:static; auto: on CUDA only)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the weights' and activations' dtype (default float32; bfloat16 on a GPU)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    return p


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class _FirstTokenClock:
    """A transformers streamer that stamps the time the first new tokens arrive (its second
    ``put``: the first one is the prompt)."""

    def __init__(self, clock) -> None:  # type: ignore[no-untyped-def]
        self.clock = clock
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = self.clock()

    def end(self) -> None:
        pass


def _synced(clock, device: torch.device):  # type: ignore[no-untyped-def]
    """``clock`` read after the device finished its work (CUDA); ``clock`` itself on the CPU."""
    if device.type != "cuda":
        return clock

    def read() -> float:
        torch.cuda.synchronize(device)
        return clock()
    return read


def _run_moeflow(model, idx_BS: torch.Tensor, n: int, clock, compile: bool = False  # type: ignore[no-untyped-def]
                 ) -> tuple[list[list[int]], float, float]:
    from moeflow.models.generation import generate

    out = generate(model, idx_BS, n, temperature=0, clock=_synced(clock, idx_BS.device), compile=compile)
    return out.tokens, out.prefill_s, out.decode_s


def _run_hf(hf, idx_BS: torch.Tensor, n: int, clock, static: bool = False  # type: ignore[no-untyped-def]
            ) -> tuple[list[list[int]], float, float]:
    """transformers' ``generate``; ``static``: with a static cache, which transformers compiles
    (``CompileConfig``; on the CPU only when told ``_compile_all_devices``)."""
    clock = _synced(clock, idx_BS.device)
    stamp = _FirstTokenClock(clock)
    kw: dict = {}
    if static:
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True, mode="reduce-overhead" if idx_BS.device.type == "cuda" else "default")
        config._compile_all_devices = True
        kw = {"cache_implementation": "static", "compile_config": config}
    with torch.no_grad():
        t0 = clock()
        out = hf.generate(idx_BS, attention_mask=torch.ones_like(idx_BS), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, num_beams=1, pad_token_id=0, streamer=stamp, **kw)
        t2 = clock()
    t1 = stamp.first if stamp.first is not None else t2
    return out[:, idx_BS.shape[1]:].tolist(), t1 - t0, t2 - t1


def take_turns(cands: dict[str, Callable[[], tuple[list[list[int]], float, float]]],
               repeats: int) -> tuple[dict[str, tuple[float, float]], dict[str, list[list[int]]]]:
    """Each candidate (a call giving its tokens, prefill and decode seconds) once a round for
    ``repeats`` rounds, in turn, the order reversed every other round (fair under a fluctuating
    load): each one's median (prefill_s, decode_s), in ``cands``' order, and its last tokens."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in cands}
    tokens: dict[str, list[list[int]]] = {}
    names = list(cands)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            toks, pre, dec = cands[name]()
            times[name].append((pre, dec))
            tokens[name] = toks
    medians = {name: (statistics.median(t[0] for t in times[name]), statistics.median(t[1] for t in times[name]))
               for name in names}
    return medians, tokens


def _first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    if a == b:
        return "identical"
    steps = [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), min(len(r), len(s))) for r, s in zip(a, b)]
    return f"differ from step {min(steps)}"


def build_models(args: argparse.Namespace, hf_dir: Path):
    """The moeflow model and transformers' model loaded from its export (both eval), on
    ``--device`` in ``--dtype``."""
    from moeflow.convert.mixtral import gpt_to_hf

    model = build_model(args, args.prompt_len + max(int(n) for n in args.new_tokens.split(",")))
    gpt_to_hf(model, hf_dir)
    dtype = getattr(torch, args.dtype)
    return model.to(device=args.device, dtype=dtype), load_hf(hf_dir).to(device=args.device, dtype=dtype)


def run_generate_bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    impls = [s for s in args.hf_experts.split(",") if s]
    clock = CLOCKS[args.clock]
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-generate-") as tmp:
        model, hf = build_models(args, Path(tmp) / "hf")
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows: list[dict] = []
    layer_rows = _layer_bench(args, model, hf, impls, clock, gen) if args.layer_tokens else []
    static = args.hf_static == "on" or (args.hf_static == "auto" and torch.device(args.device).type == "cuda")
    with torch.no_grad():
        for B in ([] if args.skip_generate else (int(b) for b in args.batch_sizes.split(","))):
            idx = torch.randint(0, args.vocab, (B, args.prompt_len), generator=gen).to(args.device)
            for n in (int(v) for v in args.new_tokens.split(",")):
                cands = {"moeflow": lambda idx=idx, n=n: _run_moeflow(model, idx, n, clock)}
                if not args.no_compiled:
                    cands["moeflow:compiled"] = lambda idx=idx, n=n: _run_moeflow(model, idx, n, clock, compile=True)
                for impl in impls:
                    cands[f"hf:{impl}"] = (lambda impl=impl, idx=idx, n=n: (hf.set_experts_implementation(impl),
                                                                            _run_hf(hf, idx, n, clock))[1])
                if static:
                    cands["hf:static"] = (lambda idx=idx, n=n: (hf.set_experts_implementation("grouped_mm"),
                                                                _run_hf(hf, idx, n, clock, static=True))[1])
                for name, run in cands.items():  # warm-up: the compiled ones compile for these shapes
                    if name in ("moeflow:compiled", "hf:static"):
                        run()
                    elif name == "moeflow":
                        _run_moeflow(model, idx, 4, clock)
                    else:
                        hf.set_experts_implementation(name[3:])
                        _run_hf(hf, idx, 4, clock)
                medians, tokens = take_turns(cands, args.repeats)
                for name, (pre, dec) in medians.items():
                    rows.append({
                        "batch": B, "new_tokens": n, "candidate": name, "prefill_s": pre, "decode_s": dec,
                        "prefill_tok_s": B * args.prompt_len / pre, "decode_tok_s": B * (n - 1) / dec if dec else None,
                        "tokens_vs_moeflow": _first_difference(tokens["moeflow"], tokens[name]),
                    })
                _print_case(rows[-len(medians):])
    return {
        "bench": "generate", "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "clock": args.clock, "torch": torch.__version__, "dtype": args.dtype,
        "device": str(args.device) + (f" ({torch.cuda.get_device_name(args.device)})"
                                      if torch.device(args.device).type == "cuda" else ""),
        "transformers": __import__("transformers").__version__, "args": {k: str(v) for k, v in vars(args).items()},
        "compiled_experts": ("packed few-row kernel (moeflow.kernels.packed_cpu)"
                             if torch.device(args.device).type == "cpu" and args.dtype == "float32"
                             and packed_cpu_available()
                             else "the weights themselves (grouped GEMM)"),
        "results": rows, "layer": layer_rows,
    }


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


def _print_case(rows: list[dict]) -> None:
    mf = max((r for r in rows if r["candidate"].startswith("moeflow")), key=lambda r: r["decode_tok_s"] or 0)
    hf_rows = [r for r in rows if not r["candidate"].startswith("moeflow")]
    best_dec = max(hf_rows, key=lambda r: r["decode_tok_s"] or 0) if hf_rows else None
    best_pre = max(hf_rows, key=lambda r: r["prefill_tok_s"]) if hf_rows else None
    print(f"B={mf['batch']} new={mf['new_tokens']}")
    for r in rows:
        print(f"  {r['candidate']:<16} prefill {r['prefill_tok_s']:>10,.0f} tok/s  decode {r['decode_tok_s'] or 0:>9,.0f} "
              f"tok/s   tokens {r['tokens_vs_moeflow']}")
    if best_dec is not None:
        print(f"  {mf['candidate']} / best transformers: decode {mf['decode_tok_s'] / best_dec['decode_tok_s']:.2f}x "
              f"({best_dec['candidate']}), prefill {mf['prefill_tok_s'] / best_pre['prefill_tok_s']:.2f}x "
              f"({best_pre['candidate']})", flush=True)


def write_report(report: dict, path: Path | None) -> None:
    """Write a bench's ``report`` as JSON to ``path`` and say so (``None``: write nothing)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}")


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.json is None:
        args.json = default_json
    write_report(run_generate_bench(args), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "generate.json"))
