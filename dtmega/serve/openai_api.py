"""OpenAI's completions API (`POST /v1/completions`), as OpenAI clients and lm-eval-harness's
`local-completions` model send it, over dtmega's engine.

Fields: `prompt` (a string, a list of strings, a list of token ids or a list of such lists),
`max_tokens` (16), `temperature` (1.0; 0 is greedy), `top_p` (1.0), `stop` (a string or up to
4), `logprobs` (null or 0-20 most likely tokens per position), `echo`, `seed`, `n` (completions
per prompt), `stream` (server-sent events, as OpenAI's clients read them; `stream_options`
`{"include_usage": true}` adds a last chunk with the token usage). `best_of` > 1, penalties,
`logit_bias` and `suffix` are refused by name, as are `logprobs` and `echo` in a stream.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from dtmega.serve.engine import Sampling, SequenceRequest, SequenceResult
from dtmega.serve.megatron_api import (
    MAX_PROMPTS,
    ContextError,
    RequestError,
    _is_int,
    _is_number,
    check_context,
)

MAX_LOGPROBS = 20
UNSUPPORTED = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
               "suffix": None}


class CompletionError(RequestError):
    """A 400 in OpenAI's error shape, naming the offending field (`param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class CompletionRequest:
    """A checked completions request: prompts as token ids, `n` sequences for each."""

    prompt_ids: list[list[int]]
    sampling: Sampling
    n: int
    echo: bool
    logprobs: int | None
    model: str
    stream: bool = False
    include_usage: bool = False


def _prompts(prompt: Any, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise CompletionError("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                          "token ids", "prompt")


@dataclass(frozen=True)
class SamplingFields:
    """The fields both OpenAI endpoints take alike, checked."""

    temperature: float
    top_p: float
    stops: tuple[str, ...]
    seed: int  # a fresh random seed where the request gives none
    stream: bool
    include_usage: bool


MAX_SEED = (1 << 63) - 1  # OpenAI's seed is an int64; a sequence draws from seed + its index (below 2^64)
MAX_STOP_CHARS = 1000  # per stop string: a stop is a few words, and each is searched after every token


def sampling_fields(body: dict, max_temperature: float) -> SamplingFields:
    """temperature (0 to `max_temperature`), top_p, stop, seed, stream and stream_options;
    `CompletionError` naming the field."""
    temperature = body.get("temperature", 1.0)
    if not _is_number(temperature) or not 0.0 <= temperature <= max_temperature:
        raise CompletionError(f"temperature must be a number from 0 (greedy) to {max_temperature:g}", "temperature")
    top_p = body.get("top_p", 1.0)
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise CompletionError("top_p must be a number in (0, 1]", "top_p")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise CompletionError("stop must be a non-empty string or a list of at most 4 of them", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):  # matrix 3, H2: 250,000-character stops stalled the server
        raise CompletionError(f"each stop string may hold at most {MAX_STOP_CHARS} characters", "stop")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise CompletionError(f"seed must be an integer from 0 to {MAX_SEED} (2^63 - 1)", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise CompletionError("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise CompletionError("stream_options is {\"include_usage\": true|false}, with stream true", "stream_options")
    return SamplingFields(float(temperature), float(top_p), tuple(stops), secrets.randbits(62) if seed is None else seed,
                          stream, bool((options or {}).get("include_usage", False)))


def parse_completion_request(body: Any, *, tokenizer, context: int, vocab_size: int, model_name: str) -> CompletionRequest:
    """Checks a completions body; raises `CompletionError` naming the field and the fix."""
    if not isinstance(body, dict):
        raise CompletionError("the request body must be a JSON object, e.g. {\"prompt\": \"Hello\"}")
    for name, default in UNSUPPORTED.items():
        if name in body and body[name] not in (default, None):
            raise CompletionError(f"{name}={body[name]!r} is not supported by dtmega serve. Fix: leave {name} out", name)
    if "prompt" not in body:
        raise CompletionError("prompt is required", "prompt")
    prompt_ids = _prompts(body["prompt"], tokenizer)
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_PROMPTS:
        raise CompletionError(f"n must be an integer from 1 to {MAX_PROMPTS}", "n")
    if len(prompt_ids) * n > MAX_PROMPTS:
        raise CompletionError(f"{len(prompt_ids)} prompts x n={n} = {len(prompt_ids) * n} completions; the most per "
                              f"request is {MAX_PROMPTS}. Fix: fewer prompts or a smaller n", "n")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = max(1, context - max(len(p) for p in prompt_ids))
    if not _is_int(max_tokens) or max_tokens < 0:
        raise CompletionError("max_tokens must be an integer >= 0", "max_tokens")
    common = sampling_fields(body, max_temperature=100.0)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise CompletionError(f"logprobs must be null or an integer from 0 to {MAX_LOGPROBS}", "logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise CompletionError("echo must be true or false", "echo")
    if max_tokens == 0 and not echo:
        raise CompletionError("max_tokens 0 returns nothing unless echo is true", "max_tokens")
    if common.stream and (logprobs is not None or echo):
        field = "logprobs" if logprobs is not None else "echo"
        raise CompletionError(f"{field} in a stream is not supported by dtmega serve. Fix: stream false, or leave "
                              f"{field} out", field)
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise CompletionError(f"prompt {i} is empty after tokenization. Fix: give some text", "prompt")
        if max(ids) >= vocab_size or min(ids) < 0:
            raise CompletionError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab_size})", "prompt")
        try:
            check_context(len(ids), max_tokens, context, what=f"prompt {i}" if len(prompt_ids) > 1 else "the prompt",
                          budget="max_tokens")
        except ContextError as error:
            raise CompletionError(str(error), error.param) from None
    sampling = Sampling(max_new_tokens=max_tokens, temperature=common.temperature, top_p=common.top_p,
                        seed=common.seed, stop_token=tokenizer.eod, stop_strings=common.stops,
                        prompt_logprobs=echo and logprobs is not None, top_logprobs=logprobs or 0)
    model = body.get("model") or model_name
    return CompletionRequest(prompt_ids, sampling, n, echo, logprobs, str(model), common.stream, common.include_usage)


def sequence_requests(request: CompletionRequest, first_id: int) -> list[SequenceRequest]:
    """n sequences per prompt, prompt-major (choice index = prompt * n + j), each its own seed."""
    prompts = [ids for ids in request.prompt_ids for _ in range(request.n)]
    return [SequenceRequest(first_id + index, ids, replace(request.sampling, seed=request.sampling.seed + index))
            for index, ids in enumerate(prompts)]


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    cuts = [text.index(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def completion_response(request: CompletionRequest, results: list[SequenceResult], tokenizer, request_id: str) -> dict:
    """OpenAI's `text_completion` object: one choice per sequence, with legacy-format logprobs
    (tokens, token_logprobs, top_logprobs, text_offset) when asked, and token usage."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, result in enumerate(results):
        prompt_text = tokenizer.decode(result.prompt_ids)
        completion = _cut_at_stop(tokenizer.decode(result.ids), request.sampling.stop_strings)
        choice = {"index": index, "text": (prompt_text if request.echo else "") + completion, "logprobs": None,
                  "finish_reason": result.finish_reason}
        if request.logprobs is not None:
            ids, values, tops = list(result.ids), list(result.logprobs), list(result.top_logprobs)
            if request.echo:
                ids = result.prompt_ids + ids
                values = [None] + (result.prompt_logprobs or []) + values
                tops = [None] + (result.prompt_top_logprobs or [{}] * (len(result.prompt_ids) - 1)) + tops
            pieces = [tokenizer.decode([t]) for t in ids]
            offsets, at = [], 0
            for piece in pieces:
                offsets.append(at)
                at += len(piece)
            choice["logprobs"] = {
                "tokens": pieces, "token_logprobs": values,
                "top_logprobs": [None if top is None else {tokenizer.decode([t]): v for t, v in top.items()}
                                 for top in tops] if request.logprobs else None,
                "text_offset": offsets}
        choices.append(choice)
        completion_tokens += len(result.ids)
        if index % request.n == 0:
            prompt_tokens += len(result.prompt_ids)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": request.model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def stream_safe_text(text: str, stops: tuple[str, ...], finished: bool) -> str:
    """The part of a sequence's text a stream may send now: cut at a stop string, and while the
    sequence runs, without a trailing undecodable byte (a character split across tokens) or a
    tail that could still grow into a stop string (which the client must never see)."""
    text = _cut_at_stop(text, stops)
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = max((_held_back(text, s) for s in stops), default=0)
    return text[:len(text) - hold]


def _held_back(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text` ends with, in one pass over
    `stop` and the last len(stop) - 1 characters (Knuth-Morris-Pratt's failure function; trying
    every prefix with `endswith` was quadratic in the stop's length after every token)."""
    tail = text[max(0, len(text) - len(stop) + 1):] if len(stop) > 1 else ""
    if not tail:
        return 0
    failure = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        if stop[i] == stop[k]:
            k += 1
        failure[i] = k
    k = 0
    for char in tail:
        while k and (k == len(stop) or char != stop[k]):
            k = failure[k - 1]
        if char == stop[k]:
            k += 1
    return min(k, len(stop) - 1)


def completion_chunk(request: CompletionRequest, request_id: str, created: int, index: int, text: str,
                     finish_reason: str | None) -> dict:
    """One server-sent event's `text_completion` object (OpenAI's streaming shape)."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": request.model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(request: CompletionRequest, request_id: str, created: int, results: list[SequenceResult]) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    prompt = sum(len(r.prompt_ids) for i, r in enumerate(results) if i % request.n == 0)
    completion = sum(len(r.ids) for r in results)
    return {"id": request_id, "object": "text_completion", "created": created, "model": request.model,
            "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}
