"""The HTTP face of ``moeflow serve``: a FastAPI app over an ``Engine`` that speaks OpenAI's API.

    app = create_app(engine, text, model_name="tiny", timeout_s=60)   # engine.start() is the caller's

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (bodies:
``moeflow.serve.protocol``; answered whole, or streamed as server-sent events ending with
``data: [DONE]``), ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (503 while
draining), ``GET /metrics`` (Prometheus text: ``moeflow.serve.metrics``).

A request becomes one engine request per choice (``n`` per prompt; choice ``j`` of a prompt draws
with ``seed + j``), submitted all or none (``Engine.submit_all``): where the queue cannot take
them all, none is queued and the answer is 429 (503 once the server is draining). Each engine request's
events arrive on the engine thread and hop to the event loop (``loop.call_soon_threadsafe``) into
the HTTP request's queue, stamped with the engine thread's clock for the latency metrics. There
the ids become text (``moeflow.serve.text``): a stop string ends a choice (finish_reason
``"stop"``, the engine request cancelled so its slot frees at once); the engine's own reasons
pass through (``"length"``, ``"stop"`` at an end-of-sequence id, ``"timeout"`` past the server's
``--timeout``, ``"shutdown"``, ``"error"``).

No request may take the server down or keep a slot: every path out of a handler (the answer, a
client that disconnects, which a watcher of the ASGI ``receive`` channel sees while a
non-streamed answer is pending and Starlette sees for a stream, an exception) cancels the engine
requests it has not seen end; an unexpected exception is a 500 with its message, and the engine
serves on. An error inside the engine's step ends the affected requests with ``"error"``: a
non-streamed answer is then a 500 naming it, a stream sends an error event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from moeflow.serve.engine import Engine, EngineClosed, Event, QueueFull, RequestSpec
from moeflow.serve.metrics import CONTENT_TYPE, CountAnswers, ServeMetrics
from moeflow.serve.protocol import (
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
from moeflow.serve.text import ModelText, NoChatTemplate, TextStream

__all__ = ["create_app", "ServeState", "MAX_BODY_BYTES", "DEFAULT_COMPLETION_TOKENS"]

MAX_BODY_BYTES = 8 << 20  # a request body past this is refused (413) before it is parsed
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions' max_tokens when not given, as OpenAI's
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclass
class ServeState:
    """What the handlers share (``app.state.serve``). ``draining``: set when shutdown begins
    (``moeflow.serve.server``): new generation requests get 503, ``/health`` says so."""

    engine: Engine
    text: ModelText
    model_name: str
    timeout_s: float | None
    metrics: ServeMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False


@dataclass
class _Choice:
    """One engine request of an HTTP request, and the text it has made so far."""

    index: int
    prompt: list[int]
    stream: TextStream
    request: object = None  # the engine's Request
    reason: str | None = None  # the finish_reason the client gets
    detail: str | None = None  # an "error"'s text
    ended: bool = False  # the engine's final event arrived (its slot is free)
    last_token_at: float | None = None
    pieces: list[str] = field(default_factory=list)


class _Job:
    """An HTTP request's choices and the queue their events hop into."""

    def __init__(self, state: ServeState, choices: list[_Choice], prompt_tokens: int) -> None:
        self.state, self.choices, self.prompt_tokens = state, choices, prompt_tokens
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()

    def submit(self, spec_of) -> None:  # type: ignore[no-untyped-def]
        """Every choice into the engine, or none (429 / 503)."""
        engine = self.state.engine
        try:
            requests = engine.submit_all([(spec_of(ch), self._callback(ch.index)) for ch in self.choices])
            for ch, request in zip(self.choices, requests):
                ch.request = request
        except QueueFull:
            raise ApiError(429, "the server is busy: every decode slot is taken and the queue is full; retry "
                           "later", code="queue_full") from None
        except EngineClosed:
            raise ApiError(503, "the server is shutting down", code="shutting_down") from None
        except ValueError as err:  # checked before submitting; kept for a check the engine adds
            raise ApiError(400, str(err)) from None

    def _callback(self, index: int):  # type: ignore[no-untyped-def]
        def on_event(event: Event) -> None:  # on the engine thread: stamp, hop, nothing more
            now = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (index, event, now))
            except RuntimeError:  # the loop is closed: the server has gone, nobody waits
                pass
        return on_event

    def cancel(self) -> None:
        """Cancel every engine request not seen to end (its slot frees before the next step)."""
        for ch in self.choices:
            if ch.request is not None and not ch.ended:
                ch.request.cancel()

    @property
    def done(self) -> bool:
        return all(ch.ended for ch in self.choices)

    async def next(self) -> tuple[_Choice, str, bool]:
        """The next event applied: ``(choice, new text, whether the choice just ended)``."""
        index, event, now = await self.events.get()
        ch = self.choices[index]
        metrics = self.state.metrics
        if event.token is not None:
            if ch.last_token_at is None:
                metrics.ttft.observe(max(0.0, now - ch.request.submitted_at))
            else:
                metrics.itl.observe(now - ch.last_token_at)
            ch.last_token_at = now
            if ch.reason is not None:  # a stop string ended it; tokens already on their way
                return ch, "", False
            piece = ch.stream.push(event.token)
            if ch.stream.stopped:
                ch.reason = "stop"
                ch.request.cancel("stop")
            return ch, piece, False
        ch.ended = True
        if ch.reason is not None:
            return ch, "", True
        piece = ch.stream.finish()  # the held text; a stop string may complete in it
        stopped = ch.stream.stopped and event.finish_reason != "error"
        ch.reason, ch.detail = ("stop" if stopped else event.finish_reason), event.detail
        return ch, piece, True

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(ch.request.completion_tokens for ch in self.choices))


def create_app(engine: Engine, text: ModelText, *, model_name: str, timeout_s: float | None = None) -> FastAPI:
    """The app over ``engine`` (started by the caller) and the model's ``text`` side;
    ``model_name`` is the only ``model`` requests may name; ``timeout_s``: each engine
    request's time limit (None: none)."""
    app = FastAPI(title="moeflow serve", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServeState(engine=engine, text=text, model_name=model_name, timeout_s=timeout_s,
                       metrics=ServeMetrics(engine.stats))
    app.state.serve = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException) -> JSONResponse:  # unknown path, wrong method
        return JSONResponse(error_body(str(err.detail), type="invalid_request_error"), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", type="server_error"),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await _body(request))
        _check_model(state, req.model)
        prompts = [_checked_prompt(state, text.encode_prompt(p), "prompt") for p in req.prompts]
        limit = req.max_tokens if req.max_tokens is not None else min(
            DEFAULT_COMPLETION_TOKENS, max(1, engine.capacity - max(map(len, prompts))))
        return await _generate(request, state, req, prompts, limit, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatRequest, await _body(request))
        _check_model(state, req.model)
        try:
            ids = text.encode_chat([m.as_template_input() for m in req.messages])
        except NoChatTemplate as err:
            raise ApiError(400, str(err), code="no_chat_template") from None
        except ValueError as err:  # the template refused the conversation (raise_exception)
            raise ApiError(400, f"messages: {err}", param="messages") from None
        prompt = _checked_prompt(state, ids, "messages")
        limit = req.token_limit if req.token_limit is not None else engine.capacity - len(prompt)
        return await _generate(request, state, req, [prompt], limit, chat=True,
                               limit_param="max_tokens" if req.max_tokens is not None else "max_completion_tokens")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        _check_model(state, model_id)
        return _model_card(state)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(CountAnswers, metrics=state.metrics, endpoints=ENDPOINTS)
    return app


async def _body(request: Request) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {size} bytes, more than {MAX_BODY_BYTES}")
    body = b""
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is more than {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:  # gone while sending the body: nobody reads an answer
        raise ApiError(499, "the client disconnected before its request was read") from None
    return body


def _check_model(state: ServeState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(404, f"model {name!r} is not served here; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _model_card(state: ServeState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "moeflow",
            "max_model_len": state.engine.capacity}


def _checked_prompt(state: ServeState, ids: list[int], param: str) -> list[int]:
    """``ids`` (a prompt's) when they are non-empty, within the vocabulary and shorter than the
    context (room for a token at least); ``ApiError`` 400 naming ``param`` otherwise."""
    capacity, vocab = state.engine.capacity, state.text.vocab_size
    if not ids:
        raise ApiError(400, f"{param}: the prompt is empty (no token)", param=param)
    if max(ids) >= vocab:
        raise ApiError(400, f"{param}: token id {max(ids)} is past the vocabulary ({vocab} ids)", param=param)
    if len(ids) >= capacity:
        raise ApiError(400, f"{param}: the prompt is {len(ids)} tokens; the context holds {capacity}, prompt and "
                       "generated tokens together", param=param, code="context_length_exceeded")
    return ids


async def _generate(request: Request, state: ServeState, req: CompletionRequest | ChatRequest, prompts: list[list[int]],
                    limit: int, *, chat: bool, limit_param: str = "max_tokens") -> Response:
    """Submit every choice, then answer whole or as a stream."""
    if state.draining:
        raise ApiError(503, "the server is shutting down", code="shutting_down")
    longest = max(map(len, prompts))
    if longest + limit > state.engine.capacity:
        raise ApiError(400, f"{limit_param}: {longest} prompt tokens + {limit_param}={limit} is more than the "
                       f"context, {state.engine.capacity} tokens", param=limit_param, code="context_length_exceeded")
    n = req.choices
    choices = [_Choice(index=i * n + j, prompt=p, stream=state.text.stream(p, req.stop or ()))
               for i, p in enumerate(prompts) for j in range(n)]
    job = _Job(state, choices, sum(map(len, prompts)))
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    job.submit(lambda ch: RequestSpec(
        prompt=tuple(ch.prompt), max_tokens=limit, temperature=temperature, top_p=top_p, top_k=req.top_k,
        seed=None if req.seed is None else req.seed + ch.index % n, stop_ids=state.text.eos_ids,
        timeout_s=state.timeout_s))
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": state.model_name}
    if req.stream:
        return StreamingResponse(_stream(job, head, chat, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(request, job, head, chat)


async def _whole(request: Request, job: _Job, head: dict, chat: bool) -> Response:
    """The answer in one body, once every choice ended; a client that leaves first cancels it."""

    async def collect() -> None:
        while not job.done:
            ch, piece, _ = await job.next()
            ch.pieces.append(piece)

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():  # the client left: nobody reads an answer
            return Response(status_code=499)
        collecting.result()
    finally:
        for task in (collecting, watching):
            task.cancel()
        job.cancel()
    failed = [ch for ch in job.choices if ch.reason == "error"]
    if failed:
        raise ApiError(500, f"the engine failed on this request: {failed[0].detail}", code="engine_error")
    texts = ["".join(ch.pieces) for ch in job.choices]
    reasons = [ch.reason for ch in job.choices]
    make = chat_body if chat else completion_body
    return JSONResponse(make(head["id"], head["created"], head["model"], texts, reasons, job.usage()))


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: ``receive`` waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that answers "no more body" at once: do not spin


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(job: _Job, head: dict, chat: bool, include_usage: bool):  # type: ignore[no-untyped-def]
    """Server-sent events: each choice's text as it is made, its finish_reason on its last
    chunk, the usage (``stream_options.include_usage``), ``[DONE]``. Leaving the loop any way
    (the client gone: Starlette cancels this generator) cancels what has not ended."""
    rid, created, model = head["id"], head["created"], head["model"]

    def chunk(ch: _Choice, piece: str, reason: str | None) -> str:
        if chat:
            return _sse(chat_chunk(rid, created, model, ch.index, {"content": piece} if piece or not reason else {},
                                   reason))
        return _sse(completion_chunk(rid, created, model, ch.index, piece, reason))

    try:
        if chat:  # the role first, as OpenAI streams it
            for ch in job.choices:
                yield _sse(chat_chunk(rid, created, model, ch.index, {"role": "assistant", "content": ""}, None))
        while not job.done:
            ch, piece, ended = await job.next()
            if piece:
                yield chunk(ch, piece, None)
            if ended:
                yield chunk(ch, "", ch.reason)
                if ch.reason == "error":
                    yield _sse(error_body(f"the engine failed on this request: {ch.detail}", type="server_error",
                                          code="engine_error"))
        if include_usage:
            make = chat_chunk if chat else completion_chunk
            yield _sse(make(rid, created, model, None, {} if chat else "", None, job.usage()))
        yield _sse("[DONE]")
    finally:
        job.cancel()
