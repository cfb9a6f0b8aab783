"""The OpenAI API as ``moeflow serve`` speaks it: the request bodies of ``/v1/completions`` and
``/v1/chat/completions`` (pydantic models, validated on arrival), the response and stream-chunk
bodies, and the error body OpenAI's clients read.

A request is refused whole, never half-served or silently adjusted: an unknown field (a typo,
or an OpenAI feature moeflow does not implement, such as ``logprobs`` or tools) and a value out
of range each get a 400 whose ``error.param`` names the field (``messages.0.role`` for a nested
one). The ranges: ``max_tokens >= 1``, ``temperature`` in [0, 2] (0: greedy), ``top_p`` in (0,
1], ``top_k >= 0`` (0 or null: no cut; not OpenAI's, but vLLM's and what clients send in
``extra_body``), ``n`` in [1, 8] (each choice is its own engine request, seeded ``seed + i``),
``seed`` in [0, 2**63 - n], ``stop`` a string or up to 4 non-empty strings, ``stream`` a bool,
``stream_options.include_usage`` only with ``stream``. ``frequency_penalty`` and
``presence_penalty`` are taken at 0 only (clients send the 0 by default; any other value would
ask for something moeflow does not do). Types are strict: ``"5"`` is not an int, ``true`` not a
number. Null means "the default" for every optional field, as OpenAI's clients send it.

What depends on the model (an empty prompt after encoding, token ids past the vocabulary, a
prompt plus ``max_tokens`` longer than the context) is checked by the app, which knows it
(``moeflow.serve.app``), and refused with the same error body.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["CompletionRequest", "ChatRequest", "ChatMessage", "StreamOptions", "ApiError", "MAX_N", "MAX_STOP",
           "parse_request", "error_body", "usage", "completion_body", "completion_chunk", "chat_body", "chat_chunk"]

MAX_N = 8  # choices per request: each one is a request in the engine's queue
MAX_STOP = 4  # stop strings per request, as OpenAI allows
SEED_LIMIT = 2**63  # the engine's generators take seeds below it (seed + n - 1 included)


class ApiError(Exception):
    """A request the server refuses: ``status`` (400, 404, 429, 503, 500) and the OpenAI error
    body's ``message``, ``type``, ``param`` (the field at fault, or None) and ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 and status != 429 else
                             "rate_limit_error" if status == 429 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:  # noqa: A002
    """``{"error": {"message", "type", "param", "code"}}``: what OpenAI's clients parse (the
    ``openai`` package raises ``BadRequestError`` etc. with this message)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _custom(message: str) -> PydanticCustomError:
    """A field's own check failed: ``message`` is the text after ``field: ``."""
    return PydanticCustomError("moeflow", "{message}", {"message": message})


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _custom(f"must be {what}, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, BaseModel) else value.model_dump_json()
    return text if len(text) <= 60 else text[:57] + "..."


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What both endpoints take: the model's name, sampling, stop strings, choices, streaming."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: tuple[str, ...] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end user's id: OpenAI's abuse tracking; recorded nowhere
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else _strings(value, "a string or a list of strings")
        if not 1 <= len(stops) <= MAX_STOP:
            raise _custom(f"must hold 1 to {MAX_STOP} strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise _custom("a stop string must not be empty")
        return tuple(stops)

    @model_validator(mode="after")
    def _together(self) -> _Sampling:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None and value != 0:
                raise _error(name, f"only 0 is supported (moeflow applies no penalty), got {value}")
        if self.stream_options is not None and not self.stream:
            raise _error("stream_options", "only allowed when stream is true")
        if self.seed is not None and self.seed + self.choices - 1 >= SEED_LIMIT:
            raise _error("seed", f"seed + n - 1 must be below 2**63 (choice i draws with seed + i), got seed="
                         f"{self.seed} with n={self.choices}")
        return self

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


def _error(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("moeflow_field", "{param}: {message}", {"param": param, "message": message})


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of
    either (several prompts: ``len(prompts) * n`` choices, prompt i's j-th at index
    ``i * n + j``, as OpenAI numbers them). ``max_tokens`` defaults to 16, as OpenAI's."""

    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        def ids(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        if isinstance(value, str) or (ids(value) and value and isinstance(value[0], int)):
            prompts = [value]
        elif isinstance(value, list) and value and all(isinstance(p, str) or ids(p) for p in value):
            prompts = value
        else:
            raise _custom("must be a string, a list of token ids, or a non-empty list of either, got "
                          f"{_show(value)}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise _custom("empty prompt" if len(prompts) == 1 else f"prompt {i} is empty")
            if not isinstance(p, str) and min(p) < 0:
                raise _custom(f"token ids must be >= 0, got {min(p)}")
        return prompts

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt  # type: ignore[return-value]  # normalised by _prompt


class ChatMessage(_Strict):
    """One message: ``content`` a string or a list of text parts (``{"type": "text", "text"}``,
    joined), the text the template receives."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict]
    name: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) for p in value):
            texts = []
            for p in value:
                if p.get("type") != "text" or not isinstance(p.get("text"), str) or set(p) != {"type", "text"}:
                    raise _custom(f"only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                  f"supported, got {_show(p)}")
                texts.append(p["text"])
            return "".join(texts)
        raise _custom(f"must be a string or a list of text parts, got {_show(value)}")

    def as_template_input(self) -> dict:
        """The message as a chat template reads it (``role``, ``content``, ``name`` if given)."""
        out = {"role": self.role, "content": self.content}
        return out if self.name is None else {**out, "name": self.name}


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered through the model's chat template.
    ``max_completion_tokens`` is OpenAI's newer name of ``max_tokens`` (one of them at most);
    without either, generation may run to the end of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise _error("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


def _param(loc: tuple) -> str | None:
    return ".".join(str(p) for p in loc) or None


def parse_request(cls: type[_Sampling], body: bytes) -> _Sampling:
    """``body`` (the raw request body) as a ``cls``; ``ApiError`` 400 naming the field (or the
    body, for malformed JSON) otherwise: the first error pydantic finds."""
    try:
        return cls.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
    kind, loc, msg = first["type"], tuple(first["loc"]), first["msg"]
    param = _param(loc)
    if kind == "json_invalid":
        raise ApiError(400, f"the request body is not valid JSON ({first['ctx'].get('error', msg)})")
    if kind == "model_type" and not loc:  # the body itself; a nested object (messages.0) is named below
        raise ApiError(400, "the request body must be a JSON object")
    if kind == "moeflow_field":  # a check across fields names its own field
        raise ApiError(400, msg, param=first["ctx"]["param"])
    if kind == "extra_forbidden":
        names = ", ".join(cls.model_fields) if len(loc) == 1 else ""
        raise ApiError(400, f"{param}: unknown or unsupported field" + (f" (this endpoint takes {names})" if names
                                                                        else ""), param=param)
    if kind == "missing":
        raise ApiError(400, f"{param}: field required", param=param)
    shown = "" if kind == "moeflow" else f", got {_show(first['input'])}"
    raise ApiError(400, f"{param}: {msg}{shown}", param=param)


# ---- response bodies (what OpenAI's clients parse)

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(id: str, created: int, model: str, texts: list[str], reasons: list[str],  # noqa: A002
                    usage_: dict) -> dict:
    """``/v1/completions``' answer: choice i's ``text`` and ``finish_reason``."""
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                        for i, (t, r) in enumerate(zip(texts, reasons))], "usage": usage_}


def completion_chunk(id: str, created: int, model: str, index: int | None, text: str,  # noqa: A002
                     reason: str | None, usage_: dict | None = None) -> dict:
    """One server-sent event of a streamed completion: choice ``index``'s new ``text`` (and its
    ``finish_reason`` on its last one); ``index`` None: the closing usage chunk, no choices."""
    choices = [] if index is None else [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage_}


def chat_body(id: str, created: int, model: str, texts: list[str], reasons: list[str],  # noqa: A002
              usage_: dict) -> dict:
    """``/v1/chat/completions``' answer: choice i's assistant message and ``finish_reason``."""
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                         "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))], "usage": usage_}


def chat_chunk(id: str, created: int, model: str, index: int | None, delta: dict,  # noqa: A002
               reason: str | None, usage_: dict | None = None) -> dict:
    """One server-sent event of a streamed chat completion: choice ``index``'s ``delta``
    (``{"role": "assistant", "content": ""}`` first, then ``{"content": text}``); ``index``
    None: the closing usage chunk."""
    choices = [] if index is None else [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
            "usage": usage_}
