"""OpenAI's chat completions API (`POST /v1/chat/completions`) over dtmega's engine.

`messages` (each a `role` of system, developer, user, assistant or tool and a string `content`,
or a list of text parts) are rendered with the served model's chat template (chat_template.py;
--chat-template, else the checkpoint's own: chat_source.py) and the assistant's turn is generated
until the template's end-of-turn token (its `eos_token`), the end-of-document token, a `stop`
string or the token budget. Fields: `n`, `max_tokens` or `max_completion_tokens` (default: the
rest of the context), `temperature` (1.0), `top_p` (1.0), `seed`, `stop` (a string or up to 4),
`logprobs` (true: each token's log-probability) with `top_logprobs` (0-20), `stream`
(server-sent `chat.completion.chunk`s; `stream_options.include_usage`). Tools, function calls,
non-text response formats, penalties and `logit_bias` are refused by name, as are logprobs in a
stream.
"""

from __future__ import annotations

import time
from typing import Any

from dtmega.data.chat_template import ChatTemplate, ChatTemplateError
from dtmega.serve.engine import Sampling, SequenceResult
from dtmega.serve.megatron_api import MAX_PROMPTS, ContextError, _is_int, check_context
from dtmega.serve.openai_api import MAX_LOGPROBS, CompletionError, CompletionRequest, _cut_at_stop, sampling_fields

ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = {"tools": None, "tool_choice": None, "functions": None, "function_call": None, "presence_penalty": 0,
               "frequency_penalty": 0, "logit_bias": None, "audio": None, "modalities": None, "prediction": None}


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise CompletionError(f"messages[{index}].content must be a string or a list of text parts "
                          "([{\"type\": \"text\", \"text\": ...}])", "messages")


def check_messages(value: Any) -> list[dict]:
    """`messages` as the template reads them ({role, content} with text content); CompletionError
    naming the message otherwise (the server's 400, `dtmega generate --chat`'s input check)."""
    if not isinstance(value, list) or not value:
        raise CompletionError("messages must be a non-empty list of {\"role\": ..., \"content\": ...}", "messages")
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise CompletionError(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise CompletionError(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        out.append({"role": role, "content": _content(message, index)})
    return out


def end_of_turn_tokens(chat: ChatTemplate, tokenizer) -> tuple[int, ...]:
    """The template's end-of-turn token (its eos_token) when the tokenizer has it as one id."""
    text = chat.special_tokens.get("eos_token")
    ids = tokenizer.encode(text) if text else []
    return tuple(ids) if len(ids) == 1 else ()


def parse_chat_request(body: Any, *, chat: ChatTemplate | None, tokenizer, context: int, vocab_size: int,
                       model_name: str) -> CompletionRequest:
    """Checks a chat body and renders its prompt; raises `CompletionError` naming the field."""
    if not isinstance(body, dict):
        raise CompletionError("the request body must be a JSON object, e.g. {\"messages\": [{\"role\": \"user\", "
                              "\"content\": \"Hello\"}]}")
    if chat is None:
        raise CompletionError("this server has no chat template (its checkpoint keeps none). Fix: start it with "
                              "--chat-template (a Hugging Face tokenizer directory or a .jinja file), or use "
                              "/v1/completions")
    for name, default in UNSUPPORTED.items():
        if name in body and body[name] not in (default, None, []):
            raise CompletionError(f"{name} is not supported by dtmega serve. Fix: leave {name} out", name)
    form = body.get("response_format")
    if form is not None and form != {"type": "text"}:
        raise CompletionError("response_format other than {\"type\": \"text\"} is not supported", "response_format")
    messages = check_messages(body.get("messages"))
    try:
        prompt = tokenizer.encode(chat.render(messages))
    except ChatTemplateError as error:
        raise CompletionError(str(error), "messages") from None
    n = body.get("n", 1)
    if not _is_int(n) or not 1 <= n <= MAX_PROMPTS:
        raise CompletionError(f"n must be an integer from 1 to {MAX_PROMPTS}", "n")
    budget_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(budget_name)
    if max_tokens is None:
        max_tokens = max(1, context - len(prompt))
    if not _is_int(max_tokens) or max_tokens < 1:
        raise CompletionError(f"{budget_name} must be an integer >= 1", budget_name)
    common = sampling_fields(body, max_temperature=2.0)
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) and logprobs is not None:
        raise CompletionError("logprobs must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS or not logprobs):
        raise CompletionError(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, with logprobs true",
                              "top_logprobs")
    if common.stream and logprobs:
        raise CompletionError("logprobs in a stream is not supported by dtmega serve. Fix: stream false, or leave "
                              "logprobs out", "logprobs")
    if not prompt:
        raise CompletionError("the rendered conversation is empty", "messages")
    if max(prompt) >= vocab_size:
        raise CompletionError("the rendered conversation holds token ids outside the vocabulary", "messages")
    try:
        check_context(len(prompt), max_tokens, context, what="the rendered conversation", budget=budget_name)
    except ContextError as error:
        raise CompletionError(str(error), "messages" if error.param == "prompt" else budget_name) from None
    sampling = Sampling(max_new_tokens=max_tokens, temperature=common.temperature, top_p=common.top_p,
                        seed=common.seed, stop_token=tokenizer.eod, stop_tokens=end_of_turn_tokens(chat, tokenizer),
                        stop_strings=common.stops, top_logprobs=top or 0)
    return CompletionRequest([prompt], sampling, n, False, (top or 0) if logprobs else None,
                             str(body.get("model") or model_name), common.stream, common.include_usage)


def _logprob_entry(tokenizer, token: int, value: float) -> dict:
    piece = tokenizer.decode([token])
    return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}


def chat_response(request: CompletionRequest, results: list[SequenceResult], tokenizer, request_id: str) -> dict:
    """OpenAI's `chat.completion` object: one assistant message per choice, token logprobs when
    asked, and the usage."""
    choices, completion_tokens = [], 0
    for index, result in enumerate(results):
        text = _cut_at_stop(tokenizer.decode(result.ids), request.sampling.stop_strings)
        logprobs = None
        if request.logprobs is not None:
            logprobs = {"content": [
                {**_logprob_entry(tokenizer, token, value),
                 "top_logprobs": [_logprob_entry(tokenizer, t, v) for t, v in (tops or {}).items()]}
                for token, value, tops in zip(result.ids, result.logprobs,
                                              result.top_logprobs or [None] * len(result.ids))], "refusal": None}
        choices.append({"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                        "logprobs": logprobs, "finish_reason": result.finish_reason})
        completion_tokens += len(result.ids)
    prompt_tokens = len(results[0].prompt_ids) if results else 0
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": request.model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}


def chat_chunk(request: CompletionRequest, request_id: str, created: int, index: int, delta: dict,
               finish_reason: str | None) -> dict:
    """One server-sent `chat.completion.chunk`: the first of a choice carries the role."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": request.model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def chat_usage_chunk(request: CompletionRequest, request_id: str, created: int, results: list[SequenceResult]) -> dict:
    """The last chunk of a chat stream with `stream_options.include_usage`."""
    prompt = len(results[0].prompt_ids) if results else 0
    completion = sum(len(r.ids) for r in results)
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": request.model,
            "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}
