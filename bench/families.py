"""The public MoE families on moeflow against transformers, whole models on the same weights in
one process: a training step (forward and backward of the language-model loss) and decoding
(moeflow's compiled decode against transformers' default ``generate`` and its static-cache
compiled ``generate``).

    python -m bench.families                              # every registered family, published shapes
    python -m bench.families --families qwen3_moe --shape tiny --repeats 2   # a quick look

Each family is built by transformers from its own config class at the family's published layer
shapes (``PUBLISHED``: Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, OLMoE-1B-7B, Moonlight-16B-A3B for
DeepSeek-V3's architecture, gpt-oss-20b, Mixtral-8x7B; two MoE layers, one for Mixtral), randomly
initialised, saved with ``save_pretrained`` and read by moeflow's converter (``gpt_from_hf``):
the same weights. What is cut to fit a 24 GiB machine with both models resident is said in each
row's ``cut`` (the vocabulary; routed experts, so that each model holds about 1 B parameters). The
training step: ``tokens`` random tokens per row, ``--train-batch`` rows, both models in train mode
without dropout, the gradients dropped after each step (no optimizer: its update is the same
elementwise work for both); transformers' experts in each of ``--hf-experts`` implementations,
the fastest taken. Decoding: ``--prompt-len`` random prompt tokens, ``--new-tokens`` greedy
tokens, for each batch size of ``--decode-batch``; the candidates take turns within every repeat
(medians); greedy tokens are compared.

Legend: ``B`` rows, ``S`` tokens a row.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS
from bench.generate_runs import CLOCKS, HFStaticGenerate, run_hf, run_moeflow, take_turns, warm_until_settled

__all__ = ["PUBLISHED", "TINY", "hf_config", "run_family", "main"]

VOCAB = 32768  # every family's vocabulary, cut to fit both models' embeddings and heads in memory

# model_type -> (transformers config class name, its keyword arguments at the published shapes,
# what was cut). Two MoE layers each (DeepSeek-V3: its first layer is dense, as published)
PUBLISHED: dict[str, tuple[str, dict, str]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        intermediate_size=6144, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
        num_hidden_layers=2), "Qwen3-30B-A3B's layers with 64 of its 128 experts; vocabulary 151,936 -> 32,768"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, intermediate_size=5632, num_experts=32, num_experts_per_tok=4,
        num_hidden_layers=2), "Qwen1.5-MoE-A2.7B's layers with 32 of its 60 experts; vocabulary 151,936 -> 32,768"),
    "olmoe": ("OlmoeConfig", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024, num_experts=64,
        num_experts_per_tok=8, clip_qkv=None, num_hidden_layers=2, eos_token_id=VOCAB - 1, pad_token_id=1),
        "OLMoE-1B-7B's layers; vocabulary 50,304 -> 32,768"),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1408,
        intermediate_size=11264, n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1,
        n_shared_experts=2, routed_scaling_factor=2.446, first_k_dense_replace=1, num_hidden_layers=3),
        "Moonlight-16B-A3B's layers (a published deepseek_v3 checkpoint: MLA without a query bottleneck, sigmoid "
        "scores with the correction bias, 2 shared experts, a dense first layer) with 32 of its 64 routed experts; "
        "vocabulary 163,840 -> 32,768. DeepSeek-V3's own layers (hidden 7,168) do not fit twice in 24 GiB"),
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
        num_local_experts=16, num_experts_per_tok=4, sliding_window=128, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"]),
        "gpt-oss-20b's layers with 16 of its 32 experts; vocabulary 201,088 -> 32,768"),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1), "one of Mixtral-8x7B's layers with 4 of its 8 experts; "
                                                     "vocabulary 32,000 -> 32,768"),
}

# the same families at test sizes (``--shape tiny``): every structural option of PUBLISHED kept
TINY: dict[str, dict] = {
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      moe_intermediate_size=32, intermediate_size=96, num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, intermediate_size=96, num_experts=8, num_experts_per_tok=2),
    "olmoe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2),
    "deepseek_v3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=32,
                        intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2),
    "gpt_oss": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
    "mixtral": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                    num_local_experts=4, num_experts_per_tok=2),
}


def hf_config(family: str, shape: str, max_seq_len: int):  # type: ignore[no-untyped-def]
    """The transformers config of ``family`` at ``shape`` (``"published"`` or ``"tiny"``)."""
    import transformers

    if family not in PUBLISHED:
        raise SystemExit(f"--families: {family!r} is not one of {', '.join(PUBLISHED)}")
    cls_name, fields, _ = PUBLISHED[family]
    if shape == "tiny":
        fields = {**fields, **TINY[family]}
    fields = {**fields, "vocab_size": VOCAB if shape == "published" else 512, "max_position_embeddings": max_seq_len,
              "tie_word_embeddings": False}
    return getattr(transformers, cls_name)(**fields)


def _build(family: str, args: argparse.Namespace, tmp: Path):  # type: ignore[no-untyped-def]
    """transformers' model of ``family`` (random, eval) and moeflow's reading of its
    ``save_pretrained`` directory: the same weights."""
    import transformers

    from moeflow.convert.hf import gpt_from_hf

    torch.manual_seed(args.seed)
    config = hf_config(family, args.shape, args.prompt_len + args.new_tokens + args.tokens)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp / family)
    model = gpt_from_hf(tmp / family).eval()
    return hf, model


def _train_step(model, run, idx_BS: torch.Tensor, clock) -> float:  # type: ignore[no-untyped-def]
    """Seconds of one forward and backward of ``run(idx_BS)``'s loss; gradients dropped after."""
    t0 = clock()
    run(idx_BS).backward()
    t1 = clock()
    model.zero_grad(set_to_none=True)
    return t1 - t0


def _train_rows(args: argparse.Namespace, hf, model, clock) -> dict:  # type: ignore[no-untyped-def]
    """Median train-step times of moeflow and of transformers' experts implementations, in turn."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx_BS = torch.randint(0, hf.config.vocab_size, (args.train_batch, args.tokens), generator=gen)
    cands = {"moeflow": (model, lambda x: model.loss(x[:, :-1], x[:, 1:]))}
    for impl in args.hf_experts:
        cands[f"hf:{impl}"] = (hf, lambda x, impl=impl: _hf_loss(hf, impl, x))
    for m, _ in cands.values():
        m.train()
    times: dict[str, list[float]] = {name: [] for name in cands}
    try:
        for name, (m, run) in cands.items():  # warm-up
            _train_step(m, run, idx_BS, clock)
        for r in range(args.repeats):
            for name in (list(cands) if r % 2 == 0 else list(cands)[::-1]):
                m, run = cands[name]
                times[name].append(_train_step(m, run, idx_BS, clock))
    finally:
        for m, _ in cands.values():
            m.eval()
    tokens = args.train_batch * (args.tokens - 1)
    med = {name: statistics.median(t) for name, t in times.items()}
    best_hf = min((n for n in med if n.startswith("hf:")), key=med.__getitem__)
    return {"tokens": tokens, "median_s": med, "tokens_per_s": {n: tokens / s for n, s in med.items()},
            "hf_best": best_hf, "ratio": med[best_hf] / med["moeflow"]}


def _hf_loss(hf, impl: str, idx_BS: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' own loss over the targets moeflow's ``loss`` takes: every next token. Its
    ``labels`` alone would be shifted inside, dropping the last row position's target."""
    hf.set_experts_implementation(impl)
    targets = idx_BS[:, 1:].contiguous()
    return hf(input_ids=idx_BS[:, :-1], labels=targets, shift_labels=targets).loss


def _decode_rows(args: argparse.Namespace, hf, model, clock, batch: int) -> dict:  # type: ignore[no-untyped-def]
    """Greedy decoding of ``batch`` rows: moeflow compiled against transformers' default
    ``generate`` and its static-cache compiled ``generate`` (each warmed up until it settles),
    in turn."""
    gen = torch.Generator().manual_seed(args.seed + 2)
    idx_BS = torch.randint(0, hf.config.vocab_size, (batch, args.prompt_len), generator=gen)
    n = args.new_tokens
    hf.set_experts_implementation(args.hf_experts[0])
    static = HFStaticGenerate(hf) if args.hf_static else None
    cands = {"moeflow:compiled": lambda: run_moeflow(model, idx_BS, n, clock, compile=True),
             "hf:generate": lambda: run_hf(hf, idx_BS, n, clock)}
    if static is not None:
        cands["hf:static"] = lambda: static(idx_BS, n, clock)
    warm = {name: warm_until_settled(run, max_calls=args.max_warmups) for name, run in cands.items()
            if name != "hf:generate"}
    cands["hf:generate"]()
    med, tokens = take_turns(cands, args.repeats)
    steps = batch * (n - 1)
    rates = {name: steps / dec for name, (_, dec) in med.items()}
    out = {"batch": batch, "tokens_per_s": rates, "warm_up_calls": {k: v["calls"] for k, v in warm.items()},
           "tokens_equal": {name: tokens[name] == tokens["hf:generate"] for name in tokens},
           "compiled_over_default": rates["moeflow:compiled"] / rates["hf:generate"]}
    if static is not None:
        out["compiled_over_static"] = rates["moeflow:compiled"] / rates["hf:static"]
    return out


def run_family(family: str, args: argparse.Namespace) -> dict:
    clock = CLOCKS[args.clock]
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-families-") as tmp:
        hf, model = _build(family, args, Path(tmp))
    params = sum(p.numel() for p in model.parameters())
    row = {"family": family, "cut": PUBLISHED[family][2] if args.shape == "published" else "tiny test shapes",
           "parameters": params}
    print(f"{family}: {params / 1e6:,.1f} M parameters ({row['cut']})", flush=True)
    row["train"] = _train_rows(args, hf, model, clock)
    print(f"  train step: moeflow {row['train']['tokens_per_s']['moeflow']:,.0f} tok/s, "
          f"{row['train']['hf_best']} {row['train']['tokens_per_s'][row['train']['hf_best']]:,.0f} tok/s: "
          f"{row['train']['ratio']:.2f}x", flush=True)
    row["decode"] = []
    for batch in args.decode_batch:
        with torch.no_grad():
            d = _decode_rows(args, hf, model, clock, batch)
        row["decode"].append(d)
        rates = d["tokens_per_s"]
        print(f"  decode B={batch}: moeflow compiled {rates['moeflow:compiled']:,.0f} tok/s, transformers' generate "
              f"{rates['hf:generate']:,.0f}: {d['compiled_over_default']:.2f}x"
              + (f"; static-cache compiled {rates['hf:static']:,.0f}: {d['compiled_over_static']:.2f}x"
                 if "compiled_over_static" in d else "")
              + f"; tokens equal: {d['tokens_equal']}", flush=True)
    del hf, model
    gc.collect()
    return row


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(PUBLISHED), help="comma-separated model types")
    p.add_argument("--shape", choices=["published", "tiny"], default="published")
    p.add_argument("--tokens", type=int, default=257, help="tokens a training row (S + 1)")
    p.add_argument("--train-batch", type=int, default=2)
    p.add_argument("--decode-batch", default="1,8", help="comma-separated rows of the decoding runs")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hf-experts", default="grouped_mm,eager", help="transformers' experts implementations (first: decode's)")
    p.add_argument("--hf-static", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' static-cache compiled generate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-warmups", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=list(CLOCKS), default="wall")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.decode_batch = [int(b) for b in args.decode_batch.split(",") if b]
    except ValueError:
        raise SystemExit(f"--decode-batch: comma-separated integers, got {args.decode_batch!r}") from None
    if not args.decode_batch or min(args.decode_batch) < 1:
        raise SystemExit(f"--decode-batch: every batch must be at least 1, got {args.decode_batch}")
    for name in ("tokens", "train_batch", "prompt_len", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < (2 if name in ("tokens", "new_tokens") else 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be at least {2 if name in ('tokens', 'new_tokens') else 1}")
    if args.max_warmups < 3:  # bench.generate_runs.warm_until_settled compares the last calls of at least 3
        raise SystemExit(f"--max-warmups must be at least 3, got {args.max_warmups}")
    args.hf_experts = [s for s in args.hf_experts.split(",") if s]
    families = [f for f in args.families.split(",") if f]
    from moeflow.convert.hf import FAMILIES

    missing = [f for f in families if f not in FAMILIES]
    if missing:
        raise SystemExit(f"--families: moeflow does not convert {', '.join(missing)} yet ({', '.join(sorted(FAMILIES))})")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = [run_family(f, args) for f in families]
    finally:
        torch.set_num_threads(threads)
    report = {"bench": "families", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "clock": args.clock, "dtype": "float32", "torch": torch.__version__,
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
    path = args.json or default_json
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "families.json"))
