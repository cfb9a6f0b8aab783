"""``moeflow.serve.protocol``: every bad request body is a 400 whose ``param`` names the field
(the message names it too), good bodies parse to what the app reads, and the response bodies
have OpenAI's shape. No server here (``test_serve_http.py`` sends these through one)."""

from __future__ import annotations

import json

import pytest

from moeflow.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_chunk,
    completion_body,
    error_body,
    parse_request,
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
