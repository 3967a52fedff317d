"""The HTTP face of `dtmega serve` (rank 0 only): FastAPI routes over the engine.

    PUT  /api              Megatron's text generation API (megatron_api.py)
    POST /v1/completions   OpenAI's completions API (openai_api.py); "stream": true for server-sent events
    POST /v1/chat/completions  OpenAI's chat API (chat_api.py): messages through the chat template
    GET  /v1/health        liveness and load: {"status": "ok", "running": ..., "waiting": ..., "slots": ...}
    GET  /v1/models        the served model, for OpenAI clients

Every handler reads the body with a size limit, checks it completely (400 with the reason),
then hands its sequences to the engine and waits without blocking the event loop. A client that
disconnects, or a request past its timeout (504), has its sequences cancelled, which frees their
slots at the engine's next step; a stream whose client leaves (or that times out) the same.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dtmega.data.chat_template import ChatTemplate
from dtmega.kernels.errors import DtmegaError
from dtmega.serve import chat_api, megatron_api, openai_api
from dtmega.serve.engine import UNAVAILABLE, Engine, SequenceRequest, SequenceResult
from dtmega.serve.megatron_api import RequestError

POLL_S = 0.05
BODY_TIMEOUT_S = 30.0


class BodyTimeoutError(RequestError):
    """The body did not arrive in time: answered 408 and the connection closed."""

    status = 408


class ShuttingDownError(RequestError):
    """The server began to stop before the body arrived: answered 503."""

    status = 503


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask: body bytes, and seconds before it is cancelled (504)."""

    max_request_bytes: int = 1 << 20
    request_timeout_s: float = 300.0

    @property
    def body_timeout_s(self) -> float:
        """Seconds a request's body may take to arrive: --request-timeout, at most 30 (a body that
        never finishes held its connection forever and 1,010 of them exhausted the server's
        descriptors: matrix 3, H20)."""
        return min(self.request_timeout_s, BODY_TIMEOUT_S)


@dataclass(frozen=True)
class ServedModel:
    """What the routes need to know about the model: its name, tokenizer and sizes."""

    name: str
    tokenizer: object
    context: int
    vocab_size: int
    chat_template: ChatTemplate | None = None  # /v1/chat/completions renders messages with it
    aliases: tuple[str, ...] = ()  # other names a request's `model` may give (vLLM's served names, the path)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may ask for; responses carry the one asked for, else `name`."""
        return (self.name, *self.aliases)


def unknown_model(body: object, model: ServedModel) -> JSONResponse | None:
    """OpenAI's and vLLM's answer to a `model` this server does not serve: 404 with code
    `model_not_found` (it used to answer any name, `gpt-4o` included, with this model)."""
    asked = body.get("model") if isinstance(body, dict) else None
    if asked in (None, "") or asked in model.names:
        return None
    served = ", ".join(repr(name) for name in model.names)
    return JSONResponse({"error": {"message": f"The model {asked!r} does not exist: this server serves {served}. Fix: "
                                              f"\"model\": {model.name!r} (GET /v1/models lists it)",
                                   "type": "invalid_request_error", "param": "model", "code": "model_not_found"}},
                        status_code=404)


class _Gone(Exception):
    """The client disconnected or the request timed out; its sequences were cancelled."""


async def _read_json(request: Request, limits: ServeLimits, stopping: threading.Event):
    """The request's JSON body: at most `max_request_bytes`, arriving within `body_timeout_s`
    (408 otherwise), parsed with nesting, huge integers and lone surrogates refused as 400s
    naming the problem (matrix 3, H4-H6: raw 500s before)."""
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the request body of {int(declared)} bytes exceeds the server's limit of {limit} bytes. "
                           "Fix: fewer or shorter prompts, or start the server with a larger --max-request-bytes")

    async def read() -> bytearray:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(f"the request body exceeds the server's limit of {limit} bytes. Fix: fewer or "
                                   "shorter prompts, or start the server with a larger --max-request-bytes")
        return body

    reading = asyncio.ensure_future(read())
    deadline = asyncio.get_running_loop().time() + limits.body_timeout_s
    try:
        while not reading.done():  # a shutdown does not wait out a body that is not coming (matrix 3, H21)
            await asyncio.wait({reading}, timeout=POLL_S)
            if stopping.is_set() and not reading.done():
                raise ShuttingDownError("the server is shutting down; the request body had not arrived. Fix: send it "
                                        "to a running server")
            if asyncio.get_running_loop().time() > deadline and not reading.done():
                raise BodyTimeoutError(f"the request body did not arrive within {limits.body_timeout_s:g} s. Fix: "
                                       "send the whole body at once")
        body = reading.result()
    finally:
        reading.cancel()
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise RequestError(f"the request body is not JSON ({reason}). Fix: send a JSON object, e.g. "
                           "-d '{\"prompts\": [\"Hello\"]}'") from None
    _check_strings(value)
    return value


def _check_strings(value) -> None:
    """Refuses a lone surrogate (\\ud800 without its pair) anywhere in the body, naming where:
    such text cannot be encoded, and the tokenizer's UnicodeEncodeError was a 500."""
    stack, path = [(value, "body")], None
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise RequestError(f"{path} holds the lone surrogate {item[error.start]!r} at character {error.start}, "
                                   "which is not text. Fix: valid UTF-8 (a surrogate pair, or the character itself)") \
                    from None
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}" if path != "body" else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))


async def _run(engine: Engine, sequences: list[SequenceRequest], request: Request, timeout: float) -> list[SequenceResult]:
    """Submits the sequences and waits for all; cancels them if the client leaves or time runs out."""
    loop = asyncio.get_running_loop()
    futures = {s.id: loop.create_future() for s in sequences}

    def resolve(result: SequenceResult) -> None:
        future = futures[result.id]
        if not future.done():
            future.set_result(result)

    for sequence in sequences:
        engine.submit(sequence, lambda result: loop.call_soon_threadsafe(resolve, result))
    deadline = loop.time() + timeout
    pending = set(futures.values())
    while pending:
        _, pending = await asyncio.wait(pending, timeout=POLL_S)
        if not pending:
            break
        gone = await request.is_disconnected()
        if gone or loop.time() > deadline:
            engine.cancel(list(futures))
            raise _Gone("the client disconnected" if gone else
                        f"the request did not finish within the server's --request-timeout of {timeout:g} s")
    return [futures[s.id].result() for s in sequences]


class DeadlineStreamingResponse(StreamingResponse):
    """A stream whose every send is bounded by the request's deadline (plus a second for the
    timeout event): a client that stops reading blocked the send forever, holding the connection
    and delaying a stop by uvicorn's whole graceful-shutdown timeout (matrix 3, H18). Past the
    deadline the stream ends and the connection is closed."""

    def __init__(self, content, deadline_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self.deadline_s = deadline_s

    async def stream_response(self, send) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s + 1.0

        async def bounded(message) -> None:
            await asyncio.wait_for(send(message), max(0.01, deadline - loop.time()))

        try:
            await super().stream_response(bounded)
        except asyncio.TimeoutError:
            return  # uvicorn closes a connection whose response did not complete


def _event(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass(frozen=True)
class StreamShape:
    """How a stream's events look (completions or chat): the chunk opening a choice (or None),
    one carrying new text, one ending a choice, and the usage chunk."""

    opening: Callable[[int], dict | None]
    text: Callable[[int, str], dict]
    finish: Callable[[int, str], dict]
    usage: Callable[[list[SequenceResult]], dict]


async def _stream(engine: Engine, parsed: openai_api.CompletionRequest, sequences: list[SequenceRequest],
                  request: Request, timeout: float, tokenizer, shape: StreamShape) -> AsyncIterator[str]:
    """An OpenAI stream: each sequence's new text as its tokens arrive (held back where it could
    still become a stop string), a last chunk per choice with its finish reason, the usage if
    asked, then [DONE]. A client that leaves, or time running out, cancels what still runs."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    first = sequences[0].id
    ids: dict[int, list[int]] = {s.id: [] for s in sequences}
    sent = dict.fromkeys(ids, 0)
    results: dict[int, SequenceResult] = {}
    for sequence in sequences:
        engine.submit(sequence, lambda r: loop.call_soon_threadsafe(events.put_nowait, ("done", r.id, r)),
                      lambda sid, token: loop.call_soon_threadsafe(events.put_nowait, ("token", sid, token)))
    deadline = loop.time() + timeout
    # the deadline also holds where this generator cannot look: a client that stops reading blocks
    # the send of a chunk, and the sequences ran on past --request-timeout (matrix 3, H18)
    watchdog = loop.call_later(timeout, engine.cancel, list(ids))
    try:
        for sequence in sequences:
            if (opening := shape.opening(sequence.id - first)) is not None:
                yield _event(opening)
        while len(results) < len(sequences):
            if loop.time() > deadline:  # checked per event too: a busy stream never waits out POLL_S (H2)
                yield _event({"error": {"message": f"the request did not finish within the server's "
                                        f"--request-timeout of {timeout:g} s", "type": "timeout", "param": None,
                                        "code": None}})
                return
            try:
                kind, sid, payload = await asyncio.wait_for(events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if kind == "token":
                ids[sid].append(payload)
            else:
                results[sid], ids[sid] = payload, list(payload.ids)
                if payload.finish_reason == "error":
                    yield _event({"error": {"message": f"generation failed: {payload.error}", "type": "server_error",
                                            "param": None, "code": None}})
                    return
            text = openai_api.stream_safe_text(tokenizer.decode(ids[sid]), parsed.sampling.stop_strings,
                                               finished=kind == "done")
            if len(text) > sent[sid]:
                yield _event(shape.text(sid - first, text[sent[sid]:]))
                sent[sid] = len(text)
            if kind == "done":
                yield _event(shape.finish(sid - first, payload.finish_reason))
        if parsed.include_usage:
            yield _event(shape.usage([results[s.id] for s in sequences]))
        yield _event("[DONE]")
    finally:
        watchdog.cancel()
        unfinished = [sid for sid in ids if sid not in results]
        if unfinished:
            engine.cancel(unfinished)


def _completion_stream(parsed: openai_api.CompletionRequest, request_id: str) -> StreamShape:
    created = int(time.time())
    return StreamShape(
        opening=lambda index: None,
        text=lambda index, text: openai_api.completion_chunk(parsed, request_id, created, index, text, None),
        finish=lambda index, reason: openai_api.completion_chunk(parsed, request_id, created, index, "", reason),
        usage=lambda results: openai_api.usage_chunk(parsed, request_id, created, results))


def _chat_stream(parsed: openai_api.CompletionRequest, request_id: str) -> StreamShape:
    created = int(time.time())
    return StreamShape(
        opening=lambda index: chat_api.chat_chunk(parsed, request_id, created, index,
                                                  {"role": "assistant", "content": ""}, None),
        text=lambda index, text: chat_api.chat_chunk(parsed, request_id, created, index, {"content": text}, None),
        finish=lambda index, reason: chat_api.chat_chunk(parsed, request_id, created, index, {}, reason),
        usage=lambda results: chat_api.chat_usage_chunk(parsed, request_id, created, results))


def _openai_error(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def _failed(results: list[SequenceResult]) -> str | None:
    errors = [r.error for r in results if r.finish_reason == "error"]
    return errors[0] if errors else None


def _failure_status(error: str) -> int:
    """503 when the server itself broke (a peer rank went away), 500 for a sequence's own failure."""
    return 503 if error.startswith(UNAVAILABLE) else 500


# What Megatron's server (Flask-RESTful on werkzeug) says for routing errors.
FLASK_MESSAGES = {
    404: "The requested URL was not found on the server. If you entered the URL manually please check your "
         "spelling and try again.",
    405: "The method is not allowed for the requested URL.",
}


def build_app(engine: Engine, model: ServedModel, limits: ServeLimits,
              stopping: threading.Event | None = None) -> FastAPI:
    """The FastAPI application of one served model; `stopping` (set when the server begins to
    stop) ends the wait for request bodies that have not arrived."""
    app = FastAPI(title="dtmega serve", description=f"text generation with {model.name}")
    stopping = stopping or threading.Event()
    issued = [0]  # sequence ids handed out (the handlers all run on the event loop's one thread)

    def next_ids(count: int) -> int:
        """The first of `count` fresh sequence ids."""
        first = issued[0]
        issued[0] += count
        return first

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        """Routing errors (wrong method, unknown path) in the shape each API's clients parse:
        OpenAI's `{"error": {...}}` under /v1/, Megatron's (Flask-RESTful) `{"message": ...}` elsewhere."""
        message = FLASK_MESSAGES.get(error.status_code, str(error.detail))
        if request.url.path.startswith("/v1/"):
            body = {"error": {"message": f"{request.method} {request.url.path}: {error.detail}",
                              "type": "invalid_request_error", "param": None, "code": None}}
        else:
            body = {"message": message}
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.put("/api")
    async def megatron_generate(request: Request):
        """Megatron's text generation request (prompts, tokens_to_generate, temperature, top_k,
        top_p, logprobs, random_seed, add_BOS, stop_token)."""
        try:
            body = await _read_json(request, limits, stopping)
            parsed = await asyncio.to_thread(megatron_api.parse_api_request, body, tokenizer=model.tokenizer,
                                             context=model.context)
        except DtmegaError as error:  # a RequestError, or the tokenizer refusing a prompt's text (C12)
            return JSONResponse({"message": str(error)}, status_code=getattr(error, "status", 400))
        sequences = megatron_api.sequence_requests(parsed, next_ids(len(parsed.prompt_ids)))
        try:
            results = await _run(engine, sequences, request, limits.request_timeout_s)
        except _Gone as gone:
            return JSONResponse({"message": str(gone)}, status_code=504)
        if (error := _failed(results)) is not None:
            return JSONResponse({"message": f"generation failed: {error}"}, status_code=_failure_status(error))
        return megatron_api.api_response(parsed, results, model.tokenizer)

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI-style completions (prompt, max_tokens, temperature, top_p, stop, logprobs,
        echo, seed, n, stream)."""
        try:
            body = await _read_json(request, limits, stopping)
            if (missing := unknown_model(body, model)) is not None:
                return missing
            parsed = await asyncio.to_thread(openai_api.parse_completion_request, body, tokenizer=model.tokenizer,
                                             context=model.context, vocab_size=model.vocab_size, model_name=model.name)
        except DtmegaError as error:
            param = getattr(error, "param", None)
            return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error", "param": param,
                                           "code": None}}, status_code=getattr(error, "status", 400))
        sequences = openai_api.sequence_requests(parsed, next_ids(len(parsed.prompt_ids) * parsed.n))
        if parsed.stream:
            return DeadlineStreamingResponse(_stream(engine, parsed, sequences, request, limits.request_timeout_s,
                                                     model.tokenizer, _completion_stream(parsed, f"cmpl-{uuid.uuid4().hex}")),
                                             limits.request_timeout_s, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
        try:
            results = await _run(engine, sequences, request, limits.request_timeout_s)
        except _Gone as gone:
            return JSONResponse({"error": {"message": str(gone), "type": "timeout", "param": None, "code": None}},
                                status_code=504)
        if (error := _failed(results)) is not None:
            return JSONResponse({"error": {"message": f"generation failed: {error}", "type": "server_error",
                                           "param": None, "code": None}}, status_code=_failure_status(error))
        return openai_api.completion_response(parsed, results, model.tokenizer, f"cmpl-{uuid.uuid4().hex}")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI-style chat completions (messages through the chat template; n, max_tokens or
        max_completion_tokens, temperature, top_p, seed, stop, logprobs, top_logprobs, stream)."""
        try:
            body = await _read_json(request, limits, stopping)
            if (missing := unknown_model(body, model)) is not None:
                return missing
            # rendering and tokenizing run off the event loop (a template's render is bounded, but
            # seconds of it must not stall health and the other clients: matrix 3, C2)
            parsed = await asyncio.to_thread(chat_api.parse_chat_request, body, chat=model.chat_template,
                                             tokenizer=model.tokenizer, context=model.context,
                                             vocab_size=model.vocab_size, model_name=model.name)
        except DtmegaError as error:
            return _openai_error(str(error), getattr(error, "status", 400), param=getattr(error, "param", None))
        sequences = openai_api.sequence_requests(parsed, next_ids(parsed.n))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if parsed.stream:
            return DeadlineStreamingResponse(_stream(engine, parsed, sequences, request, limits.request_timeout_s,
                                                     model.tokenizer, _chat_stream(parsed, request_id)),
                                             limits.request_timeout_s, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache"})
        try:
            results = await _run(engine, sequences, request, limits.request_timeout_s)
        except _Gone as gone:
            return _openai_error(str(gone), 504, "timeout")
        if (error := _failed(results)) is not None:
            return _openai_error(f"generation failed: {error}", _failure_status(error), "server_error")
        return chat_api.chat_response(parsed, results, model.tokenizer, request_id)

    @app.get("/v1/health")
    async def health():
        """Liveness and load of the engine: 503 "stalled" when it has work but has not finished a
        step within --request-timeout (every request would time out), so a balancer's probe sees
        a server that can no longer generate (matrix 3, H1: it said ok while nothing ran)."""
        load = engine.load()
        if engine.broken:
            return JSONResponse({"status": "broken", "reason": engine.broken, "model": model.name, **load},
                                status_code=503)
        stalled = (load["running"] or load["waiting"]) and load["seconds_since_step"] > limits.request_timeout_s
        if stalled:
            return JSONResponse({"status": "stalled", "model": model.name, **load}, status_code=503)
        return {"status": "ok", "model": model.name, **load}

    @app.get("/v1/models")
    async def models():
        """The one model this server serves (OpenAI's model list)."""
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "dtmega"} for name in model.names]}

    return app
