"""``moeflow serve`` end to end: the server in a subprocess on 127.0.0.1 (a free port), talked to
through the real ``openai`` client and raw HTTP (``httpx2``, the client ``openai`` uses).

The model is a tiny Mixtral written by moeflow itself (``gpt_to_hf``, random weights, fp64 so
that a batched decode step and a lone one pick the same greedy tokens to the last bit), with a
character-level tokenizer (every id shows in the text), a chat template in its
``tokenizer_config.json``, and two end-of-sequence ids: ``</s>`` and a character the model's
greedy continuation of ``PROMPT`` reaches (found when the model is made), so a greedy reply
ends with finish_reason "stop" at a known place. A second copy without the chat template is
served by a small server (one slot, one queue place, a per-request timeout): the 429, timeout
and no-template cases. The SIGTERM test starts a server of its own.

What is compared with what: a reply's text with ``moeflow.models.generation.generate`` on the same
model and prompt (greedy), decoded whole (``reference_text``); streamed chunks with the
non-streamed body; seeded samples with the same request again and with choice ``j`` of ``n``."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

CHARS = "abcdefghijklmnopqrstuvwxyz :.,"
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
CONTEXT = 8192  # the model's max_seq_len: the small server's requests may be long
SERVED = 512  # the main server's --context (its 16 slots' cache columns each)
LONG = CONTEXT - 64  # a request far longer than TIMEOUT at any speed (the bare model has no end-of-sequence id)
TIMEOUT = 2.0  # the small server's --timeout
PROMPT = "the cat sat"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ('system', 'user', 'assistant') %}"
            "{{ raise_exception('no ' ~ m['role'] ~ ' turns here') }}{% endif %}{{ m['role'][0] }}:{{ m['content'] }}"
            "\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
NAME = "tiny"


def _tokenizer_json() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok.to_str()


def _write(model, path: Path, eos: list[int] | None, template: str | None) -> Path:  # type: ignore[no-untyped-def]
    """The model as a Hugging Face directory; ``eos`` None: no end-of-sequence id at all (the
    tokenizer's end-of-document token none either)."""
    from moeflow.convert.hf import gpt_to_hf

    config = {"bos_token": "<s>"} | ({"eos_token": "</s>"} if eos else {}) | (
        {"chat_template": template} if template else {})
    gpt_to_hf(model, path, family="mixtral", special_tokens={"bos_token_id": 1, "eos_token_id": eos,
                                                              "pad_token_id": None},
              tokenizer={"kind": "hf", "json": _tokenizer_json(), "eod": eos[0] if eos else None},
              files={"tokenizer_config.json": json.dumps(config)})
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The model directories (module docstring) and the model and tokenizer the tests compare
    with, loaded as the server loads them."""
    from moeflow.cli.serve import load_served_model
    from moeflow.convert.mixtral import gpt_config_from_hf
    from moeflow.models import MoEGPT
    from moeflow.models.generation import generate

    root = tmp_path_factory.mktemp("serve")
    cfg = gpt_config_from_hf({"model_type": "mixtral", "vocab_size": len(VOCAB), "hidden_size": 32,
                              "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                              "max_position_embeddings": CONTEXT})
    model = MoEGPT(cfg, dtype=torch.float64)
    gen = torch.Generator().manual_seed(48)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))  # peaked: varied greedy text
    first = _write(model, root / "probe", [2], TEMPLATE)
    model, tok, _ = load_served_model(first, "cpu")
    ids = tok.encode(PROMPT)
    greedy = generate(model, [ids], 24, temperature=0).tokens[0]
    # the second end-of-sequence id: a character the greedy reply reaches after a few others
    at = next(i for i in range(6, 24) if greedy[i] not in greedy[:i] and min(greedy[:i + 1]) > 2)
    eos = [2, greedy[at]]
    path = _write(model, root / NAME, eos, TEMPLATE)
    bare = _write(model, root / "bare", None, None)
    shutil.rmtree(first)
    model, tok, _ = load_served_model(path, "cpu")
    return {"path": path, "bare": bare, "model": model, "tok": tok, "eos": eos, "stop_at": at}


def reference(tiny: dict, ids: list[int], max_tokens: int) -> tuple[str, str, int]:
    """``(text, finish_reason, completion tokens)`` of greedy ``generate`` on the same model."""
    from moeflow.models.generation import generate
    from moeflow.serve.text import reference_text

    out = generate(tiny["model"], [ids], max_tokens, temperature=0, eos=tiny["eos"]).tokens[0]
    stopped = bool(out) and out[-1] in tiny["eos"]
    return reference_text(tiny["tok"], ids, out[:-1] if stopped else out), "stop" if stopped else "length", len(out)


class Server:
    """``moeflow serve`` in a subprocess on a free port of 127.0.0.1, its output in a file."""

    def __init__(self, path: Path, log: Path, *flags: str) -> None:
        self.log = log
        for _ in range(3):  # a free port may be taken between finding it and binding it
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            with open(log, "w") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "moeflow", "serve", str(path), "--host", "127.0.0.1", "--port",
                     str(self.port), "--threads", "1", "--model-name", NAME, "--no-access-log", *flags],
                    stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if self._ready():
                break
        else:
            raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}")
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=60, trust_env=False)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                                    http_client=httpx.Client(timeout=60, trust_env=False))

    def _ready(self, timeout: float = 120) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "cannot listen" in self.log.read_text():
                    return False
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2, trust_env=False).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server was not ready in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = self.http.get("/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def wait_idle(self, timeout: float = 20) -> None:
        """Until no request holds a slot or waits for one."""
        deadline = time.monotonic() + timeout
        while self.metric("moeflow_running_requests") + self.metric("moeflow_queue_length") > 0:
            assert time.monotonic() < deadline, "requests still running"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):  # type: ignore[no-untyped-def]
    s = Server(tiny["path"], tmp_path_factory.mktemp("log") / "server.log", "--max-concurrency", "16",
               "--max-queue", "64", "--context", str(SERVED))
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):  # type: ignore[no-untyped-def]
    """One slot, one queue place, requests end after ``TIMEOUT``; the model without a chat
    template or an end-of-sequence id (a request runs to its max_tokens)."""
    s = Server(tiny["bare"], tmp_path_factory.mktemp("log") / "small.log", "--max-concurrency", "1",
               "--max-queue", "1", "--timeout", str(TIMEOUT))
    yield s
    assert s.stop() == 0, s.log.read_text()[-3000:]


def _words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(n))


@pytest.fixture
def rng(gen: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=gen, device="cpu")))


def test_models_health_and_metrics(server) -> None:
    assert [m.id for m in server.client.models.list().data] == [NAME]
    assert server.client.models.retrieve(NAME).id == NAME
    assert server.http.get("/health").json() == {"status": "ok"}
    metrics = server.http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert server.metric("moeflow_slots") == 16
    for name in ("moeflow_queue_length", "moeflow_batch_occupancy", "moeflow_time_to_first_token_seconds_count",
                 "moeflow_inter_token_latency_seconds_count", "moeflow_generation_tokens_total"):
        assert name in metrics.text


def test_a_completion_is_the_text_of_generate_with_usage_and_finish_reason(server, tiny) -> None:
    """Greedy: the text ``generate`` gives, ending at the declared end-of-sequence id ("stop",
    the id counted in the usage, not shown), or at max_tokens ("length")."""
    ids = tiny["tok"].encode(PROMPT)
    before = server.metric("moeflow_generation_tokens_total")
    done = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    text, reason, n = reference(tiny, ids, 24)
    assert (reason, n) == ("stop", tiny["stop_at"] + 1)
    assert (done.choices[0].text, done.choices[0].finish_reason) == (text, "stop")
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        len(ids), n, len(ids) + n)
    assert server.metric("moeflow_generation_tokens_total") - before == n
    short = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert (short.choices[0].text, short.choices[0].finish_reason, short.usage.completion_tokens) == (
        text[:3], "length", 3)
    assert done.id.startswith("cmpl-") and done.model == NAME and done.object == "text_completion"


def test_a_stop_string_ends_the_text_before_it(server, tiny) -> None:
    text, _, _ = reference(tiny, tiny["tok"].encode(PROMPT), 24)
    stop = text[2:4]
    cut = text[:text.find(stop)]
    done = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stop=[stop, "zzzz"])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (cut, "stop")
    streamed = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                                stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    server.wait_idle()  # the cancelled request freed its slot


def test_streamed_chunks_concatenate_to_the_whole_answer(server, tiny, rng) -> None:
    prompt = _words(rng, 9)
    whole = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(server.client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    with server.http.stream("POST", "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 4,
                                                             "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_answers_through_the_models_template(server, tiny) -> None:
    """The messages rendered as the template says (written out here), encoded without added
    tokens, answered as greedy ``generate`` answers those ids; streamed: the role first."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    ids = tiny["tok"].encode(f"<s>s:be brief\nu:{PROMPT}\na:", add_special_tokens=False)
    text, reason, n = reference(tiny, ids, 30)
    done = server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (text, reason)
    assert done.choices[0].message.role == "assistant" and done.usage.prompt_tokens == len(ids)
    assert done.usage.completion_tokens == n and done.object == "chat.completion"
    chunks = list(server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=30,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason
    # without max_tokens the reply may run to the end of the context
    free = server.client.chat.completions.create(model=NAME, messages=messages, temperature=0)
    assert (free.choices[0].message.content, free.choices[0].finish_reason, free.usage.completion_tokens) == (
        reference(tiny, ids, SERVED - len(ids)))
    bad = server.http.post("/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "tool", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert "no tool turns here" in bad.json()["error"]["message"]


def test_concurrent_greedy_requests_equal_sequential_generate(server, tiny, rng) -> None:
    prompts = [_words(rng, rng.randint(1, 40)) for _ in range(12)]
    limits = [rng.randint(1, 30) for _ in prompts]

    def ask(i: int) -> tuple[str, str, int]:
        c = server.client.completions.create(model=NAME, prompt=prompts[i], max_tokens=limits[i], temperature=0)
        return c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(ask, range(12)))
    assert got == [reference(tiny, tiny["tok"].encode(p), m) for p, m in zip(prompts, limits)]


def test_seeded_sampling_is_reproducible_and_choice_j_draws_with_seed_plus_j(server) -> None:
    def ask(seed: int, n: int = 1) -> list[str]:
        c = server.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, top_p=0.95,
                                             seed=seed, n=n, extra_body={"top_k": 20})
        return [ch.text for ch in sorted(c.choices, key=lambda ch: ch.index)]

    with ThreadPoolExecutor(4) as pool:  # beside other requests: a request's draws are its own
        first, many, *_ = pool.map(lambda a: ask(*a), [(7, 1), (7, 3), (100, 2), (200, 2)])
    assert ask(7) == first
    assert many == [first[0], ask(8)[0], ask(9)[0]]
    assert len(set(many)) > 1  # different seeds, different samples (20 tokens from ~20 choices each)


def test_two_hundred_requests_at_concurrency_16_all_answered(server, rng) -> None:
    """A bounded load test: none lost, no 5xx (the queue holds them all: no 429 either)."""
    bodies = [{"model": NAME, "prompt": _words(rng, rng.randint(1, 20)), "max_tokens": rng.randint(1, 6),
               "temperature": rng.choice([0, 0.8]), "stream": rng.random() < 0.3} for _ in range(200)]
    before = server.metric("moeflow_http_requests_total", endpoint="/v1/completions", status="200")

    def send(body: dict) -> tuple[int, str | None]:
        r = server.http.post("/v1/completions", json=body)
        if body["stream"]:
            return r.status_code, r.text.rstrip().rsplit("\n", 1)[-1]
        return r.status_code, r.json()["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, bodies))
    assert [status for status, _ in answers] == [200] * 200
    assert all(end == "data: [DONE]" if b["stream"] else end in ("stop", "length") for b, (_, end) in
               zip(bodies, answers))
    assert server.metric("moeflow_http_requests_total", endpoint="/v1/completions", status="200") - before == 200
    server.wait_idle()


BAD_INPUTS = [  # (endpoint, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": NAME, "prompt": "a", "colour": "red"}, 400, "colour"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "n": 20}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "a" * SERVED}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": SERVED - 3}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": [5, len(VOCAB)]}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a" * SERVED}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": SERVED},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "dog", "content": "a"}]}, 400, "messages.0.role"),
]


def test_bad_input_is_a_400_naming_the_field(server) -> None:
    for path, body, status, param in BAD_INPUTS:
        r = server.http.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
        assert param is None or param in r.json()["error"]["message"]
    assert server.http.get("/v1/nothing").status_code == 404
    from moeflow.serve.app import MAX_BODY_BYTES

    huge = server.http.post("/v1/completions", content=b" " * (MAX_BODY_BYTES + 1))
    assert huge.status_code == 413 and "more than" in huge.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client.completions.create(model=NAME, prompt="a", temperature=2.5)
    assert server.client.completions.create(model=NAME, prompt="a", max_tokens=1).choices[0].finish_reason


def test_a_client_that_disconnects_frees_its_slot(small) -> None:
    """Mid-stream, and while waiting for a whole answer: the engine requests are cancelled (not
    run on to their end), nothing stays running, and the server serves on."""
    small.wait_idle()
    cancelled = small.metric("moeflow_engine_finished_total", reason="cancelled")
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG, "stream": True}
    with small.http.stream("POST", "/v1/completions", json=body) as r:
        assert next(line for line in r.iter_lines() if line).startswith("data: {")  # it runs
    small.wait_idle()
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up waiting for a whole answer
        small.http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
    small.wait_idle()
    assert small.metric("moeflow_engine_finished_total", reason="cancelled") - cancelled == 2
    assert small.metric("moeflow_http_requests_total", endpoint="/v1/completions", status="499") >= 1
    assert small.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_beyond_the_queue_a_request_gets_429(small) -> None:
    """One slot and one queue place: a request needing three places (n=3) is refused whole, and
    a third concurrent request is refused while one runs and one waits; both 429, and the
    server serves on."""
    small.wait_idle()
    r = small.http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 2, "n": 3})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert small.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, n=2).usage.completion_tokens == 4
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG, "stream": True}
    with small.http.stream("POST", "/v1/completions", json=body) as running:
        lines = running.iter_lines()  # kept: a line iterator dropped unfinished closes the connection
        assert next(line for line in lines if line).startswith("data: {")
        with small.http.stream("POST", "/v1/completions", json=body) as waiting:
            assert waiting.status_code == 200
            deadline = time.monotonic() + 10
            while small.metric("moeflow_queue_length") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(openai.RateLimitError, match="busy"):
                small.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
    small.wait_idle()
    assert small.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).choices[0].finish_reason == "length"


def test_a_request_past_the_servers_timeout_ends_with_finish_reason_timeout(small) -> None:
    small.wait_idle()
    started = time.monotonic()
    done = small.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=LONG)
    assert done.choices[0].finish_reason == "timeout" and 0 < done.usage.completion_tokens < LONG
    assert done.choices[0].text
    assert TIMEOUT <= time.monotonic() - started < TIMEOUT + 10


def test_chat_without_a_chat_template_is_a_400_saying_so(small) -> None:
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        small.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])


def test_an_unexpected_error_is_a_500_and_sigterm_ends_the_requests_in_flight_and_exits_0(tiny, tmp_path) -> None:
    """A request that raises where nothing expects it is a 500 and the server serves on. Then,
    two requests running and one waiting: SIGTERM stops admission (503), the waiting one ends
    "shutdown", the running ones finish or end "shutdown" after the grace period, every stream
    ends with [DONE], and the server exits 0."""
    (tmp_path / "boom.jinja").write_text("{% for m in messages %}{{ (1 / 0) if m['content'] == 'boom' else "
                                         "m['content'] }}{% endfor %}")
    s = Server(tiny["bare"], tmp_path / "term.log", "--max-concurrency", "2", "--max-queue", "2",
               "--shutdown-grace", "0.5", "--chat-template", str(tmp_path / "boom.jinja"))
    # first, a request that raises where nothing expects it (a template dividing by zero): a 500
    # naming the error, and the server serves on
    boom = s.http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "boom"}]})
    assert boom.status_code == 500 and "ZeroDivisionError" in boom.json()["error"]["message"]
    assert s.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "fine"}],
                                            max_tokens=3).usage.completion_tokens == 3
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG, "stream": True}

    def stream() -> list[str]:
        with s.http.stream("POST", "/v1/completions", json=body) as r:
            return [line for line in r.iter_lines() if line]

    try:
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream) for _ in range(3)]
            deadline = time.monotonic() + 20
            while s.metric("moeflow_running_requests") < 2 or s.metric("moeflow_queue_length") < 1:
                assert time.monotonic() < deadline, "the requests did not start"
                time.sleep(0.02)
            s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while s.http.get("/health").status_code != 503:  # admission stops
                assert time.monotonic() < deadline
            late = s.http.post("/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 1})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            ends = [f.result(timeout=60) for f in streams]
        assert s.proc.wait(60) == 0, s.log.read_text()[-3000:]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    reasons = sorted(json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] for lines in ends)
    assert all(lines[-1] == "data: [DONE]" for lines in ends)
    assert reasons in (["shutdown"] * 3, ["length", "shutdown", "shutdown"], ["length", "length", "shutdown"])


def _main(argv: list[str]) -> int:
    """``moeflow`` in process: its status (argparse's refusals exit)."""
    from moeflow.cli.main import main

    try:
        return main(argv)
    except SystemExit as exit:
        return int(exit.code)


@pytest.mark.parametrize("flags,named", [
    (["--port", "70000"], "--port"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--timeout", "0"], "--timeout"),
    (["--shutdown-grace", "-1"], "--shutdown-grace"),
    (["--fast-memory", "1GB"], "--fast-memory"),  # a storage flag without --offload
    (["--offload", "host", "--compile"], "--compile"),
    (["--offload", "disk", "--fast-memory", "12XB"], "--fast-memory"),
    (["--device", "tpu"], "--device"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["--model-name", ""], "--model-name"),
])
def test_bad_flags_are_one_line_naming_the_flag(tiny, capsys, flags: list[str], named: str) -> None:
    status = _main(["serve", str(tiny["path"]), "--port", "0", *flags])
    err = capsys.readouterr().err
    assert status in (1, 2) and err.count("\n") == 1 and err.startswith("moeflow serve: error:") and named in err, err


def test_a_taken_port_or_a_missing_model_is_refused_before_loading(tiny, tmp_path, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        status = _main(["serve", str(tiny["path"]), "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert status == 2 and "cannot listen" in err and "--port" in err and "device:" not in err  # nothing loaded
    assert _main(["serve", str(tmp_path / "nothing")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_a_checkpoint_serves_as_the_directory_it_was_converted_from(tiny, tmp_path, capsys) -> None:
    """``moeflow serve`` takes a moeflow checkpoint (``build_from_checkpoint``) or a Hugging Face
    directory (converted in memory): the same weights, tokenizer, stop ids and chat template."""
    from moeflow.cli.generate import declared_eos
    from moeflow.cli.serve import load_served_model
    from moeflow.convert.chat import chat_template

    assert _main(["convert", "--from-hf", str(tiny["path"]), str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    (a, tok_a, extra_a), (b, tok_b, extra_b) = (load_served_model(p, "cpu") for p in (tiny["path"], tmp_path / "ck"))
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(x, b.state_dict()[k]) for k, x in a.state_dict().items())
    assert tok_a.encode(PROMPT) == tok_b.encode(PROMPT) == tiny["tok"].encode(PROMPT)
    assert declared_eos(extra_a, tok_a, len(VOCAB), "a") == declared_eos(extra_b, tok_b, len(VOCAB), "b") == tiny["eos"]
    assert chat_template(extra_a, "a") == chat_template(extra_b, "b") == TEMPLATE


def test_offloaded_experts_serve_the_same_tokens(tiny, tmp_path) -> None:
    """``--offload disk`` with a fast tier holding a few of the experts only: concurrent greedy
    answers are still ``generate``'s on the in-memory model."""
    from moeflow.cli.offload import expert_bytes

    budget = expert_bytes(tiny["model"]) // 4
    s = Server(tiny["path"], tmp_path / "offload.log", "--max-concurrency", "4", "--context", str(SERVED),
               "--offload", "disk", "--fast-memory", str(budget), "--dir", str(tmp_path / "tier"))
    try:
        prompts = [PROMPT, "a dog", "sat on the mat", "x"]

        def ask(prompt: str) -> tuple[str, str, int]:
            c = s.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
            return c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, prompts))
        assert got == [reference(tiny, tiny["tok"].encode(p), 12) for p in prompts]
    finally:
        assert s.stop() == 0, s.log.read_text()[-3000:]
    assert "peak fast-tier bytes" in s.log.read_text()  # the store's report on the way out
