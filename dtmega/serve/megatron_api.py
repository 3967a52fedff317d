"""Megatron's text generation API (`PUT /api`): its request fields, its error messages, its
response (`text`, `segments`, `tokens`, `logprobs`), over dtmega's engine.

    curl 'http://localhost:5000/api' -X PUT -H 'Content-Type: application/json; charset=UTF-8' \
         -d '{"prompts":["Hello world"], "tokens_to_generate":1}'

Megatron's defaults: 64 tokens, temperature 1.0, no top-k (0) and no top-p (0.0); top_k 1 is
greedy. The stop token (default: the tokenizer's end of document) ends a sequence and is not
part of the response (lm-eval-harness's Megatron client reads the response that way).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any

from dtmega.kernels.errors import DtmegaError
from dtmega.serve.engine import Sampling, SequenceRequest, SequenceResult

MAX_PROMPTS = 128
# Megatron's other fields, refused by name when they ask for something dtmega's engine does not do
# (silently ignoring beam_width would answer a different question than the one asked).
UNSUPPORTED = {"beam_width": None, "top_p_decay": 0.0, "top_p_bound": 0.0, "stop_on_double_eol": False,
               "stop_on_eol": False, "prevent_newline_after_colon": False, "length_penalty": 1}


MAX_SEED = (1 << 63) - 1  # prompt i draws from random_seed + i, which stays below torch's 2^64


class RequestError(DtmegaError):
    """A request the server answers with HTTP 400 and this message."""


@dataclass
class ApiRequest:
    """A checked `/api` request: its prompts' token ids (with BOS when asked) and settings."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    sampling: Sampling
    logprobs: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_api_request(body: Any, *, tokenizer, context: int) -> ApiRequest:
    """Checks a `/api` body field by field in Megatron's order, with Megatron's messages (plus
    the context check Megatron makes inside generation); raises `RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object, e.g. {\"prompts\": [\"Hello\"]}")
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    if "max_len" in body:
        raise RequestError("max_len is no longer used.  Replace with tokens_to_generate")
    if "sentences" in body:
        raise RequestError("sentences is no longer used.  Replace with prompts")
    for name, default in UNSUPPORTED.items():
        if name in body and body[name] not in (default, None):
            raise RequestError(f"{name}={body[name]!r} is not supported by dtmega serve. Fix: leave {name} out")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if len(prompts) == 0:
        raise RequestError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS}")
    tokens_to_generate = body.get("tokens_to_generate", 64)
    if not _is_int(tokens_to_generate):
        raise RequestError("tokens_to_generate must be an integer greater than 0")
    if tokens_to_generate < 0:
        raise RequestError("tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError("logprobs must be a boolean value")
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    temperature = body.get("temperature", 1.0)
    if not _is_number(temperature) or not 0.0 < temperature <= 100.0:
        raise RequestError("temperature must be a positive number less than or equal to 100.0")
    top_k = body.get("top_k", 0)
    if not _is_int(top_k):
        raise RequestError("top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
    if not 0 <= top_k <= 1000:
        raise RequestError("top_k must be equal to or greater than 0 and less than or equal to 1000")
    top_p = body.get("top_p", 0.0)
    if not _is_number(top_p):
        raise RequestError("top_p must be a positive float less than or equal to 1.0")
    if top_p > 0.0 and top_k > 0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    if not 0 <= top_p <= 1.0:
        raise RequestError("top_p must be less than or equal to 1.0")
    add_bos = body.get("add_BOS", False)
    if not isinstance(add_bos, bool):
        raise RequestError("add_BOS must be a boolean value")
    if any(len(p) == 0 for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true")
    random_seed = body.get("random_seed", -1)
    if not _is_int(random_seed):
        raise RequestError("random_seed must be integer")
    if "random_seed" in body and random_seed < 0:
        raise RequestError("random_seed must be a positive integer")
    if random_seed > MAX_SEED:  # matrix 3, H1: 2^70 overflowed the engine's generator
        raise RequestError(f"random_seed must be at most {MAX_SEED} (2^63 - 1)")
    stop_token = body.get("stop_token", tokenizer.eod)
    if not _is_int(stop_token):
        raise RequestError("stop_token must be an integer")
    prompt_ids = [([tokenizer.eod] if add_bos else []) + tokenizer.encode(p) for p in prompts]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise RequestError(f"prompt {i} is empty after tokenization. Fix: give some text, or add_BOS=true")
        check_context(len(ids), tokens_to_generate, context, what=f"prompt {i}" if len(prompts) > 1 else "the prompt",
                      budget="tokens_to_generate")
    seed = random_seed if random_seed >= 0 else secrets.randbits(62)
    sampling = Sampling(max_new_tokens=tokens_to_generate, temperature=float(temperature), top_k=top_k,
                        top_p=float(top_p) if top_p > 0 else 1.0, seed=seed, stop_token=stop_token,
                        prompt_logprobs=logprobs)
    return ApiRequest(prompts, prompt_ids, sampling, logprobs)


class ContextError(RequestError):
    """A request longer than the server's context; `param` names what to shorten."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_context(prompt_tokens: int, new_tokens: int, context: int, *, what: str, budget: str) -> None:
    """Prompt + new tokens must fit the server's context (the model's RoPE table, or a shorter
    --max-model-len: a KV cache slot). A prompt that leaves no room for one generated token is
    the prompt's fault (shorten it); otherwise the number of new tokens is (`budget` names it)."""
    if prompt_tokens + new_tokens <= context:
        return
    if prompt_tokens >= context:
        raise ContextError(
            f"{what} has {prompt_tokens} tokens, but the server's context holds {context} tokens, the generated ones "
            f"included. Fix: a prompt of at most {context - 1} tokens", param="prompt")
    raise ContextError(
        f"{what} ({prompt_tokens} tokens) + {budget} {new_tokens} = {prompt_tokens + new_tokens} tokens exceeds the "
        f"server's context of {context} tokens. Fix: {budget} {context - prompt_tokens} or less", param=budget)


def sequence_requests(request: ApiRequest, first_id: int) -> list[SequenceRequest]:
    """One engine sequence per prompt; prompt i draws from seed + i (the same request with the
    same random_seed gives the same texts)."""
    return [SequenceRequest(first_id + i, ids, replace(request.sampling, seed=request.sampling.seed + i))
            for i, ids in enumerate(request.prompt_ids)]


def api_response(request: ApiRequest, results: list[SequenceResult], tokenizer) -> dict:
    """Megatron's response: per prompt the prompt + generated text, every token as text
    (`segments`), the token ids, and (with logprobs) log p of every token after the first."""
    texts, segments, tokens, logprobs = [], [], [], []
    for prompt, result in zip(request.prompts, results):
        ids = result.prompt_ids + result.ids
        texts.append(prompt + tokenizer.decode(result.ids))
        segments.append([tokenizer.decode([t]) for t in ids])
        tokens.append(ids)
        if request.logprobs:
            logprobs.append((result.prompt_logprobs or []) + result.logprobs)
    return {"text": texts, "segments": segments, "tokens": tokens, "logprobs": logprobs if request.logprobs else None}
