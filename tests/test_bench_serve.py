"""``python -m bench.serve`` (moeflow serve under load beside sequential generate and
transformers' generate): its flags refused by name, its quantile, a request that errors or ends
badly refused (a fake stream), a server that does not start or a request that fails ending the
run with the server's log tail (the levels before kept in the JSON), and (slow tier) a whole run
at tiny shapes in bf16 reporting every level with the tokens it asked for. No timing is
asserted."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
aiohttp = pytest.importorskip("aiohttp")

from bench import serve  # noqa: E402


@pytest.mark.unit
@pytest.mark.parametrize("argv, match", [
    (["--requests", "0"], "--requests must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--concurrency", "1,64", "--slots", "32"], "--concurrency: every level must be in"),
    (["--concurrency", "0"], "--concurrency: every level must be in"),
    (["--concurrency", "1,eight"], "--concurrency: comma-separated integers, got '1,eight'"),
    (["--start-timeout", "0"], "--start-timeout must be a positive number of seconds, got 0.0"),
    (["--start-timeout", "nan"], "--start-timeout must be a positive number of seconds, got nan"),
    (["--baselines", "moeflow,vllm"], "--baselines: 'vllm' \\(the baselines: moeflow, transformers"),
    (["--baselines", "moeflow,moeflow"], "--baselines: a name twice"),
    (["--device", "gpu"], "--device: cpu or cuda\\[:N\\], got 'gpu'"),
    (["--device", "cuda:x"], "--device: cpu or cuda\\[:N\\], got 'cuda:x'"),
    (["--context", "1"], "--context must be at least 2, got 1"),
])
def test_bad_flags_are_refused_by_name(argv, match):
    with pytest.raises(SystemExit, match=match):
        serve.main(argv)


@pytest.mark.unit
@pytest.mark.parametrize("argv, needle", [
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--shape", "huge"], "argument --shape: invalid choice: 'huge'"),
])
def test_bad_choices_are_refused_by_argparse_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit):
        serve.main(argv)
    assert needle in capsys.readouterr().err


@pytest.mark.unit
def test_cuda_without_a_gpu_is_refused_and_the_device_picks_the_defaults():
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: no CUDA device is visible"):
            serve.main(["--device", "cuda"])
    cpu = serve._check(serve._parser().parse_args([]))
    assert (cpu.dtype, cpu.shape, cpu.baselines) == ("float32", "small", ["moeflow", "transformers"])
    assert serve._check(serve._parser().parse_args(["--baselines", ""])).baselines == []
    # the GPU preset: Qwen3-30B-A3B's layer, 64 experts top-8, 8 layers, the 32,768-id vocabulary
    gpu = serve.SHAPES["gpu"]
    assert (gpu["hidden_size"], gpu["num_hidden_layers"], gpu["num_experts"], gpu["num_experts_per_tok"],
            gpu["moe_intermediate_size"], serve.VOCAB["gpu"]) == (2048, 8, 64, 8, 768, 32768)


@pytest.mark.unit
def test_the_quantile_interpolates_between_order_statistics():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert serve._quantile(xs, 0.0) == 1.0 and serve._quantile(xs, 1.0) == 5.0
    assert serve._quantile(xs, 0.5) == 3.0
    assert serve._quantile(xs, 0.99) == pytest.approx(4.96)
    assert serve._quantile([7.0], 0.99) == 7.0


def _stream(*chunks: dict | str, status: int = 200) -> tuple[int, str]:
    """What a server answering a completion with these server-sent events (then ``[DONE]``) sends."""
    return status, "".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in (*chunks, "[DONE]"))


def _chunk(text: str, reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": reason}]}


def _one(answer: tuple[int, str]) -> dict:
    """``serve._one`` against a server on 127.0.0.1 that sends ``answer`` (status, body) in
    pieces of 7 bytes, so that lines arrive split."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    status, body = answer

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        data = body.encode()
        for i in range(0, len(data), 7):
            await resp.write(data[i:i + 7])
        await resp.write_eof()
        return resp

    async def go() -> dict:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with TestServer(app, host="127.0.0.1") as server, serve.client_session(2) as session:
            return await serve._one(session, str(server.make_url("/v1/completions")), "a prompt", 3)
    return asyncio.run(go())


_USAGE = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


@pytest.mark.unit
def test_a_request_counts_only_when_it_ended_by_stop_or_length():
    row = _one(_stream(_chunk("a"), _chunk(" b"), _chunk(" c"), _chunk("", "length"), _USAGE))
    assert row["tokens"] == 3 and row["latency_s"] >= row["ttft_s"] > 0
    assert _one(_stream(_chunk("a"), _chunk("", "stop"), _USAGE))["tokens"] == 3
    # the engine failed on the request: its stream ends with finish_reason "error" and an error body, answered 200
    error = {"error": {"message": "the engine failed on this request: boom", "type": "server_error"}}
    with pytest.raises(RuntimeError, match="the stream carried an error: .*boom"):
        _one(_stream(_chunk("a"), _chunk("", "error"), error, _USAGE))
    with pytest.raises(RuntimeError, match="finish_reason 'timeout'"):
        _one(_stream(_chunk("a"), _chunk("", "timeout"), _USAGE))
    with pytest.raises(RuntimeError, match="finish_reason None"):  # a stream cut short
        _one(_stream(_chunk("a"), _USAGE))
    with pytest.raises(RuntimeError, match="HTTP 429"):
        _one(_stream(_chunk("a"), status=429))


@pytest.mark.e2e
def test_a_server_that_does_not_start_ends_the_run_with_its_log(tmp_path):
    args = serve._check(serve._parser().parse_args(["--shape", "tiny", "--slots", "2", "--concurrency", "1",
                                                    "--start-timeout", "120", "--no-compile", "--threads", "1"]))
    log = tmp_path / "server.log"
    with pytest.raises(SystemExit) as ended:
        serve._start_server(args, tmp_path / "no-model", serve._free_port(), log, 64)
    message = str(ended.value)
    assert message.startswith("moeflow serve did not start (moeflow serve exited with 2; its log")
    assert "no such checkpoint or Hugging Face directory" in message and message.endswith(log.read_text().strip())


@pytest.mark.unit
def test_a_failed_request_ends_the_run_with_the_server_log_and_keeps_the_levels_before(tmp_path, monkeypatch):
    log, out = tmp_path / "server.log", tmp_path / "serve.json"
    log.write_text("moeflow serve: 'moeflow' on http://127.0.0.1:1\nERROR: the decode step failed: CUDA error\n")
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the server, still up
    stopped = []
    monkeypatch.setattr(serve, "_build", lambda args, root: (root, ["p1", "p2"], {"vocab": 9, "parameters": 99, "context": 64}))
    monkeypatch.setattr(serve, "_start_server", lambda args, path, port, log, context: stand_in)
    monkeypatch.setattr(serve, "_stop", lambda proc: (proc.kill(), proc.wait(), stopped.append(proc)))

    async def level(url: str, prompts: list[str], c: int, n: int, max_tokens: int) -> dict:
        if c == 2:
            raise RuntimeError("the request ended with finish_reason 'error'")
        return {"concurrency": c, "requests": n, "tokens": 3 * n, "wall_s": 1.0, "tokens_per_s": 3.0 * n,
                "ttft_p50_s": 0.1, "latency_p50_s": 0.5, "latency_p99_s": 0.6}

    monkeypatch.setattr(serve, "_level", level)
    with pytest.raises(SystemExit) as ended:
        serve.main(["--shape", "tiny", "--concurrency", "1,2", "--slots", "2", "--requests", "2",
                    "--server-log", str(log), "--json", str(out)])
    message = str(ended.value)
    assert message.startswith("a request at concurrency 2 failed: RuntimeError: the request ended with "
                              "finish_reason 'error' (moeflow serve still running; its log")
    assert message.endswith("ERROR: the decode step failed: CUDA error") and stopped == [stand_in]
    report = json.loads(out.read_text())
    assert report["complete"] is False and [r["concurrency"] for r in report["serve"]] == [1]
    assert (report["vocab"], report["parameters"], report["dtype"], report["device"]) == (9, 99, "float32", "cpu")

    # every level served, then the run dies in transformers' loop: moeflow's row and the ratio are kept
    monkeypatch.setattr(serve, "_level", lambda url, prompts, c, n, max_tokens: level(url, prompts, 16, n, max_tokens))

    def baselines(args, path, prompts, done):  # type: ignore[no-untyped-def]
        done({"moeflow generate": {"tokens_per_s": 12.0, "peak_gib": None}})
        raise MemoryError("transformers generate")

    monkeypatch.setattr(serve, "_sequential", baselines)
    monkeypatch.setattr(serve, "_start_server", lambda args, path, port, log, context: subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"]))
    with pytest.raises(MemoryError):
        serve.main(["--shape", "tiny", "--concurrency", "16", "--slots", "16", "--requests", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["complete"] is False and list(report["sequential"]) == ["moeflow generate"]
    assert report["summary"] == {"c16_over_sequential_generate": 0.5}  # 6 tok/s at 16 over 12 one at a time


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_run_in_bf16_reports_every_level_and_both_baselines(tmp_path):
    out, log = tmp_path / "serve.json", tmp_path / "server.log"
    assert serve.main(["--shape", "tiny", "--concurrency", "1,2", "--requests", "3", "--max-tokens", "5",
                       "--prompt-len", "8", "--slots", "2", "--no-compile", "--threads", "1", "--dtype", "bfloat16",
                       "--server-log", str(log), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and (report["dtype"], report["device"], report["vocab"]) == ("bfloat16", "cpu", 512)
    assert [r["concurrency"] for r in report["serve"]] == [1, 2]
    for row in report["serve"]:
        assert row["requests"] == 3 and 3 <= row["tokens"] <= 15 and row["latency_p99_s"] >= row["latency_p50_s"] > 0
        assert row["server_device_gib"] is None  # the CPU: no device counter
    assert set(report["sequential"]) == {"moeflow generate", "transformers generate"}
    assert all(row["peak_gib"] is None for row in report["sequential"].values())
    # greedy on the same bf16 weights: the server and both baselines generate as many tokens
    assert report["sequential"]["moeflow generate"]["tokens"] == report["sequential"]["transformers generate"]["tokens"]
    assert report["serve"][0]["tokens"] == report["sequential"]["moeflow generate"]["tokens"]
    # its log, kept where asked; its slots sized to the longest request (as generate sizes its cache)
    assert f"slots of {report['context']} tokens" in log.read_text() and report["context"] >= 8 + 5
    assert "moeflow serve: 'moeflow' on http://127.0.0.1:" in log.read_text()
