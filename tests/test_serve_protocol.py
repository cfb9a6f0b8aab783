"""``moeflow.serve.protocol``: every bad request body is a 400 whose ``param`` names the field
(the message names it too), good bodies parse to what the app reads, and the response bodies
have OpenAI's shape. No server here (``test_serve_http.py`` sends these through one)."""

from __future__ import annotations

import json
import random
import string

import pytest
import torch

from moeflow.serve.protocol import (
    MAX_N,
    MAX_STOP,
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    error_body,
    parse_request,
    usage,
)

pytestmark = pytest.mark.unit

GOOD = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# (endpoint's body, the param the 400 names); None: no field (the body itself)
BAD = [
    (GOOD | {"max_tokens": 0}, "max_tokens"),
    (GOOD | {"max_tokens": "5"}, "max_tokens"),  # strict types: a string is no int
    (GOOD | {"max_tokens": 5.5}, "max_tokens"),
    (GOOD | {"temperature": 2.5}, "temperature"),
    (GOOD | {"temperature": -0.1}, "temperature"),
    (GOOD | {"temperature": True}, "temperature"),
    (GOOD | {"top_p": 0}, "top_p"),
    (GOOD | {"top_p": 1.01}, "top_p"),
    (GOOD | {"top_k": -1}, "top_k"),
    (GOOD | {"n": 0}, "n"),
    (GOOD | {"n": 9}, "n"),
    (GOOD | {"seed": -1}, "seed"),
    (GOOD | {"seed": 2**63 - 1, "n": 2}, "seed"),  # choice 1 would draw with 2**63
    (GOOD | {"seed": "7"}, "seed"),
    (GOOD | {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (GOOD | {"stop": ""}, "stop"),
    (GOOD | {"stop": ["a", 3]}, "stop"),
    (GOOD | {"stream": "yes"}, "stream"),
    (GOOD | {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    (GOOD | {"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    (GOOD | {"presence_penalty": 0.5}, "presence_penalty"),
    (GOOD | {"frequency_penalty": -1}, "frequency_penalty"),
    (GOOD | {"logprobs": 2}, "logprobs"),  # an OpenAI field moeflow does not implement
    (GOOD | {"temprature": 0.5}, "temprature"),  # a typo
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": ["a", ""]}, "prompt"),
    ({"model": "m", "prompt": [1, -2]}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m"}, "prompt"),
    ({"prompt": "hi"}, "model"),
    (CHAT | {"messages": []}, "messages"),
    (CHAT | {"messages": [5]}, "messages.0"),  # a nested object that is none: named, not "the body"
    (CHAT | {"messages": [{"role": "user", "content": "x"}, "hi"]}, "messages.1"),
    (GOOD | {"stream": True, "stream_options": 5}, "stream_options"),
    (GOOD | {"stream": True, "stream_options": [True]}, "stream_options"),
    (CHAT | {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    (CHAT | {"messages": [{"role": "user"}]}, "messages.0.content"),
    (CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    (CHAT | {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
    (CHAT | {"max_tokens": 3, "max_completion_tokens": 3}, "max_completion_tokens"),
    (CHAT | {"max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_a_bad_body_is_a_400_naming_its_field(body: dict, param: str) -> None:
    cls = ChatRequest if "messages" in body else CompletionRequest
    with pytest.raises(ApiError) as caught:
        parse_request(cls, json.dumps(body).encode())
    err = caught.value
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")
    assert err.message.startswith(f"{param}: ")
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": None}}


@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe", b'{"model": "m", "prompt": "hi",}'])
def test_malformed_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(CompletionRequest, raw)
    assert caught.value.status == 400 and caught.value.param is None and "not valid JSON" in caught.value.message


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"null"])
def test_a_body_that_is_no_object_is_a_400(raw: bytes) -> None:
    with pytest.raises(ApiError, match="must be a JSON object") as caught:
        parse_request(ChatRequest, raw)
    assert caught.value.status == 400


def test_good_bodies_parse_to_what_the_app_reads() -> None:
    req = parse_request(CompletionRequest, json.dumps(GOOD).encode())
    assert (req.prompts, req.choices, req.stop, req.include_usage, req.temperature) == (["hi"], 1, None, False, None)
    req = parse_request(CompletionRequest, json.dumps(
        {"model": "m", "prompt": [[5, 6], "x"], "n": 3, "stop": "\n", "temperature": 0, "seed": 2**63 - 3,
         "stream": True, "stream_options": {"include_usage": True}, "top_k": 0, "presence_penalty": 0,
         "max_tokens": None, "user": "u1"}).encode())
    assert (req.prompts, req.choices, req.stop, req.include_usage, req.top_k) == ([[5, 6], "x"], 3, ("\n",), True, 0)
    assert parse_request(CompletionRequest, b'{"model": "m", "prompt": [7, 8]}').prompts == [[7, 8]]
    chat = parse_request(ChatRequest, json.dumps(CHAT | {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"}],
        "max_completion_tokens": 4}).encode())
    assert [m.as_template_input() for m in chat.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab", "name": "ann"}]
    assert chat.token_limit == 4


def test_response_bodies_have_openais_shape() -> None:
    body = completion_body("cmpl-1", 5, "m", ["ab", "c"], ["length", "stop"], {"prompt_tokens": 2,
                           "completion_tokens": 3, "total_tokens": 5})
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["object"] == "text_completion"
    assert body["choices"][1] == {"index": 1, "text": "c", "logprobs": None, "finish_reason": "stop"}
    assert chat_chunk("c-1", 5, "m", None, {}, None, {"total_tokens": 1})["choices"] == []
    assert error_body("no", type="server_error") == {"error": {"message": "no", "type": "server_error",
                                                               "param": None, "code": None}}


@pytest.fixture
def rng(gen: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=gen, device="cpu")))


def _refused(cls: type, body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_request(cls, json.dumps(body).encode())
    return caught.value


# every field each endpoint takes: what the refusal of an unknown top-level field lists
SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
                   "stream_options", "user", "frequency_penalty", "presence_penalty"}
FIELDS = {CompletionRequest: SAMPLING_FIELDS | {"prompt"},
          ChatRequest: SAMPLING_FIELDS | {"messages", "max_completion_tokens"}}

# (body, the whole message): moeflow's own checks say what is wrong once, with the value at fault
MESSAGES = [
    (GOOD | {"stop": ["a", "b", "c", "d", "e"]}, "stop: must hold 1 to 4 strings, got 5"),
    (GOOD | {"stop": []}, "stop: must hold 1 to 4 strings, got 0"),
    (GOOD | {"stop": ["a", 3]}, 'stop: must be a string or a list of strings, got ["a", 3]'),
    (GOOD | {"stop": 7}, "stop: must be a string or a list of strings, got 7"),
    (GOOD | {"stop": ["a", ""]}, "stop: a stop string must not be empty"),
    ({"model": "m", "prompt": [1, -2]}, "prompt: token ids must be >= 0, got -2"),
    ({"model": "m", "prompt": ["a", ""]}, "prompt: prompt 1 is empty"),
    ({"model": "m", "prompt": ""}, "prompt: empty prompt"),
    ({"model": "m", "prompt": 5},
     "prompt: must be a string, a list of token ids, or a non-empty list of either, got 5"),
    (CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     'messages.0.content: only text parts ({"type": "text", "text": ...}) are supported, got {"type": "text", '
     '"text": "a", "x": 1}'),
    (GOOD | {"presence_penalty": 0.5}, "presence_penalty: only 0 is supported (moeflow applies no penalty), got 0.5"),
    (GOOD | {"stream": False, "stream_options": {"include_usage": True}},
     "stream_options: only allowed when stream is true"),
    (GOOD | {"seed": 2**63 - 2, "n": 3},
     f"seed: seed + n - 1 must be below 2**63 (choice i draws with seed + i), got seed={2**63 - 2} with n=3"),
    (CHAT | {"max_tokens": 3, "max_completion_tokens": 3},
     "max_completion_tokens: give max_tokens or max_completion_tokens, not both"),
    ({"prompt": "hi"}, "model: field required"),
    (CHAT | {"messages": [{"content": "x"}]}, "messages.0.role: field required"),
    (GOOD | {"stream_options": {"include_usage": True, "extra": 1}, "stream": True},
     "stream_options.extra: unknown or unsupported field"),
    (CHAT | {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages.0.tool_calls: unknown or unsupported field"),
]


@pytest.mark.parametrize("body,message", MESSAGES, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(MESSAGES)])
def test_a_refusal_says_what_is_wrong_once(body: dict, message: str) -> None:
    """The message a client shows its user: the field, what is wrong, the value at fault (once;
    a nested unknown field names itself, not the endpoint's fields)."""
    err = _refused(ChatRequest if "messages" in body else CompletionRequest, body)
    assert (err.status, err.message, err.param) == (400, message, message.split(":")[0])


@pytest.mark.parametrize("cls", [CompletionRequest, ChatRequest])
def test_an_unknown_field_is_refused_with_the_fields_the_endpoint_takes(cls: type, rng: random.Random) -> None:
    base = GOOD if cls is CompletionRequest else CHAT
    for name in ["logprobs", "tools", "".join(rng.choice(string.ascii_lowercase) for _ in range(8))]:
        err = _refused(cls, base | {name: 1})
        head, _, listed = err.message.partition(" (this endpoint takes ")
        assert (err.param, head) == (name, f"{name}: unknown or unsupported field") and listed.endswith(")")
        assert set(listed[:-1].split(", ")) == FIELDS[cls]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", 2.5), ("top_p", 0), ("n", MAX_N + 1),
                                         ("seed", -1), ("max_tokens", "5"), ("stream", "yes"), ("top_k", -3)])
def test_a_value_pydantic_refuses_is_shown_after_its_reason(field: str, value: object) -> None:
    err = _refused(CompletionRequest, GOOD | {field: value})
    assert err.param == field and err.message.startswith(f"{field}: ")
    assert err.message.endswith(f", got {json.dumps(value)}") and err.message.count(", got ") == 1
    assert len(err.message) > len(f"{field}: , got {json.dumps(value)}")  # pydantic's reason between them


def test_a_long_value_is_shown_cut_to_60_characters(rng: random.Random) -> None:
    """Through moeflow's own checks and pydantic's both: up to 60 characters whole, longer ones
    cut to their first 57 and "..."."""
    for extra in (-1, 0, 1, rng.randint(2, 200)):
        value = {"k": "".join(rng.choice(string.ascii_letters) for _ in range(51 + extra))}  # 60 + extra as JSON
        shown = json.dumps(value)
        assert len(shown) == 60 + extra
        expect = shown if len(shown) <= 60 else shown[:57] + "..."
        assert _refused(CompletionRequest, GOOD | {"stop": value}).message == \
            f"stop: must be a string or a list of strings, got {expect}"
        assert _refused(CompletionRequest, GOOD | {"max_tokens": value}).message.endswith(f", got {expect}")


def test_values_on_each_side_of_a_limit() -> None:
    """Each range's own ends are taken; one step past either is refused (``BAD`` has more)."""
    ok = [{"max_tokens": 1}, {"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"top_p": 1e-9}, {"top_k": 0},
          {"n": 1}, {"n": MAX_N}, {"seed": 0}, {"seed": 2**63 - 1}, {"seed": 2**63 - MAX_N, "n": MAX_N},
          {"stop": ["a"] * MAX_STOP}, {"frequency_penalty": 0.0}, {"stream": False}]
    for extra in ok:
        req = parse_request(CompletionRequest, json.dumps(GOOD | extra).encode())
        assert {k: getattr(req, k) for k in extra} == {k: tuple(v) if k == "stop" else v for k, v in extra.items()}
    bad = [({"temperature": 2.0000001}, "temperature"), ({"seed": 2**63}, "seed"),
           ({"seed": 2**63 - MAX_N + 1, "n": MAX_N}, "seed"), ({"n": 1.0}, "n"), ({"top_k": True}, "top_k")]
    for extra, param in bad:
        assert _refused(CompletionRequest, GOOD | extra).param == param
    assert parse_request(ChatRequest, json.dumps(CHAT | {"max_completion_tokens": 1}).encode()).token_limit == 1
    assert parse_request(ChatRequest, json.dumps(CHAT | {"max_tokens": 7}).encode()).token_limit == 7
    assert parse_request(ChatRequest, json.dumps(CHAT).encode()).token_limit is None


def test_stop_strings_are_taken_as_given(rng: random.Random) -> None:
    for k in range(1, MAX_STOP + 1):
        stops = ["".join(rng.choice("ab\n日🙂") for _ in range(rng.randint(1, 5))) for _ in range(k)]
        req = parse_request(ChatRequest, json.dumps(CHAT | {"stop": stops}).encode())
        assert req.stop == tuple(stops)
    assert parse_request(ChatRequest, json.dumps(CHAT | {"stop": None}).encode()).stop is None


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (404, "invalid_request_error"),
                                         (413, "invalid_request_error"), (499, "invalid_request_error"),
                                         (429, "rate_limit_error"), (500, "server_error"), (503, "server_error")])
def test_an_error_bodys_type_follows_its_status(status: int, kind: str) -> None:
    """OpenAI's clients raise by status and read ``type``: a client error, the rate limit (retry
    later), the server's fault; a type given explicitly wins; param and code reach the body."""
    err = ApiError(status, "what went wrong")
    assert (err.status, err.type, str(err)) == (status, kind, "what went wrong")
    assert err.body() == {"error": {"message": "what went wrong", "type": kind, "param": None, "code": None}}
    err = ApiError(status, "m", param="n", code="some_code", type="other_error")
    assert err.body() == {"error": {"message": "m", "type": "other_error", "param": "n", "code": "some_code"}}
    assert ApiError(status, "m", code="c").body()["error"]["code"] == "c"


def _texts(rng: random.Random, n: int) -> tuple[list[str], list[str]]:
    texts = ["".join(rng.choice("ab \n日🙂") for _ in range(rng.randint(0, 9))) for _ in range(n)]
    return texts, [rng.choice(["stop", "length", "error"]) for _ in range(n)]


def test_usage_counts_prompt_and_completion_and_their_sum(rng: random.Random) -> None:
    for _ in range(5):
        p, c = rng.randint(0, 10**6), rng.randint(0, 10**6)
        assert usage(p, c) == {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def test_whole_answers_have_openais_shape(rng: random.Random) -> None:
    n, created, rid = rng.randint(1, 6), rng.randint(0, 2**31), f"cmpl-{rng.getrandbits(32):x}"
    model = "m-" + str(rng.random())
    texts, reasons = _texts(rng, n)
    used = usage(rng.randint(1, 99), rng.randint(0, 99))
    assert completion_body(rid, created, model, texts, reasons, used) == {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]} for i in range(n)],
        "usage": used}
    assert chat_body(rid, created, model, texts, reasons, used) == {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": None,
                     "finish_reason": reasons[i]} for i in range(n)],
        "usage": used}


def test_stream_chunks_have_openais_shape(rng: random.Random) -> None:
    """A choice's chunk (its new text, its finish_reason on the last), and the closing usage
    chunk: no choices, the usage; choice chunks carry ``usage: null`` (include_usage's format)."""
    created, rid, model = rng.randint(0, 2**31), f"x-{rng.getrandbits(32):x}", "m"
    index, (texts, reasons), used = rng.randint(0, 7), _texts(rng, 1), usage(3, 4)
    for reason in (None, reasons[0]):
        assert completion_chunk(rid, created, model, index, texts[0], reason) == {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": texts[0], "logprobs": None, "finish_reason": reason}], "usage": None}
        for delta in ({"role": "assistant", "content": ""}, {"content": texts[0]}, {}):
            assert chat_chunk(rid, created, model, index, delta, reason) == {
                "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
                "usage": None}
    assert completion_chunk(rid, created, model, None, "", None, used) == {
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": used}
    assert chat_chunk(rid, created, model, None, {}, None, used) == {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
        "usage": used}
    assert completion_chunk(rid, created, model, 0, "a", None, used)["usage"] == used  # given: passed on
