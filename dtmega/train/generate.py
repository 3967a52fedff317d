"""`dtmega generate`: sample from a checkpoint with a KV cache, on one rank or under TP.

    dtmega generate --load runs/demo/checkpoints --prompt "In the beginning"
    torchrun --nproc-per-node 2 -m dtmega generate --load ckpt --prompt "..." --tensor-model-parallel-size 2
    dtmega generate --load sft-ckpt --chat --message "system:Be brief." --message "user:What is 2 plus 2?"

`--chat` answers a conversation (chat_messages.py) as `dtmega serve`'s /v1/chat/completions
does: rendered with the same chat template (--chat-template, else the checkpoint's own:
dtmega/serve/chat_source.py) and its generation prompt, generated until the template's end of
turn, and only the assistant's answer printed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from dtmega.data.tokenizers import Tokenizer
from dtmega.kernels.errors import DtmegaError
from dtmega.models.kv_cache import KVCache, decoding_families
from dtmega.printing import console
from dtmega.progress import progress_bar
from dtmega.serve.chat_api import end_of_turn_tokens
from dtmega.serve.chat_source import choose_chat_template
from dtmega.serve.kv_budget import describe_kv_cache
from dtmega.train.chat_messages import chat_messages
from dtmega.train.restore import (
    CheckpointHead,
    add_model_source,
    read_source_head,
    restore_with_progress,
)
from dtmega.train.sampling import choose_next, sample_next  # noqa: F401  (sample_next: public here too)


@dataclass
class Generation:
    """What `generate_tokens` produced: the new token ids (without the end-of-document token
    that stopped it) and each choice's margin (`dtmega.train.sampling`), the stopping choice's
    included (so `margins` is one longer than `ids` when end-of-document stopped it)."""

    ids: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)


@torch.no_grad()
def generate_tokens(model: torch.nn.Module, prompt_ids: list[int], *, vocab_size: int, eod: int | None,
                    max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 50, top_p: float = 0.95,
                    seed: int = 0, on_token: Callable[[], None] | None = None,
                    stop_tokens: tuple[int, ...] = ()) -> Generation:
    """Continues `prompt_ids` with a KV cache; stops at `eod`, at any of `stop_tokens` (a chat
    template's end of turn) or after `max_new_tokens`. Identical on every rank of a TP group
    (same seed, same gathered logits). `on_token()` after each chosen token (a progress bar's
    `advance`)."""
    if not prompt_ids:
        raise DtmegaError("the prompt is empty after tokenization; give some text")
    device = next(model.buffers()).device
    cache = KVCache(len(prompt_ids) + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt_ids], device=device)
    result = Generation()
    for _ in range(max_new_tokens):
        logits = model(tokens, cache=cache)[:, -1]
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logits[:, vocab_size:] = float("-inf")  # padded vocabulary rows are never real tokens
        choice = choose_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        next_id = int(choice.ids)
        result.margins.append(float(choice.margins))
        if on_token is not None:
            on_token()
        if next_id == eod or next_id in stop_tokens:
            break
        result.ids.append(next_id)
        tokens = choice.ids.view(1, 1)
    return result


def generate(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int = 64,
             temperature: float = 0.8, top_k: int = 50, top_p: float = 0.95, seed: int = 0,
             on_token: Callable[[], None] | None = None, stop_tokens: tuple[int, ...] = ()) -> str:
    """Continues `prompt` (text in, text out); see `generate_tokens`."""
    produced = generate_tokens(model, tokenizer.encode(prompt), vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
                               max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, on_token=on_token, stop_tokens=stop_tokens)
    return tokenizer.decode(produced.ids)


def check_request(head: CheckpointHead, prompt: str, max_new_tokens: int, what: str = "the prompt") -> int:
    """The prompt is text (UTF-8) and prompt + new tokens fit the model's context, checked from
    the checkpoint's files before any weight is loaded or KV cache allocated. `what` names the
    prompt in the message (--chat: the rendered conversation). Returns the positions the
    generation uses (prompt + new tokens)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DtmegaError(f"{'--prompt' if what == 'the prompt' else what} holds bytes that are not UTF-8 text (from "
                         f"character {error.start}: {prompt[error.start:error.end]!r}). Fix: pass the text as "
                         "UTF-8") from None
    context = getattr(head.config, "max_seq_len", None)
    used = len(head.tokenizer.encode(prompt))
    if context is not None and used + max_new_tokens > context:
        raise DtmegaError(
            f"{what} ({used} tokens) + --max-new-tokens {max_new_tokens} = {used + max_new_tokens} tokens exceeds "
            f"the model's context of {context} tokens (its max position embeddings). Fix: --max-new-tokens "
            f"{max(context - used, 0)} or less" + (", and a shorter prompt" if used >= context else "")
        )
    return used + max_new_tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega generate", description="Sample text from a checkpoint.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_source(p)
    p.add_argument("--prompt", help="text to continue (or --chat)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0 = no nucleus filter")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (launch that many ranks)")
    p.add_argument("--custom-import", nargs="+", default=[], help="modules that register the checkpoint's model")
    chat = p.add_argument_group("chat", "--chat: answer a conversation as dtmega serve's /v1/chat/completions does "
                                "(the same chat template, stopped at its end of turn); prints only the answer")
    chat.add_argument("--chat", action="store_true", help="answer the conversation of --messages and --message")
    chat.add_argument("--message", action="append", default=[], metavar="ROLE:TEXT",
                      help="one message (repeatable, in order, after --messages'): ROLE is system, developer, user, "
                           "assistant or tool, always given; TEXT is everything after the first colon, verbatim")
    chat.add_argument("--messages", metavar="FILE", help="a JSON list of {\"role\": ..., \"content\": ...} (or "
                                                         "{\"messages\": [...]})")
    chat.add_argument("--chat-template", help="a Hugging Face tokenizer directory or a .jinja file (default: the "
                                              "checkpoint's own: the tokenizer files a fine-tune of a Hugging Face "
                                              "model keeps, or --load-hf's)")
    return p


def check_mode(a: argparse.Namespace) -> None:
    """--prompt, or --chat with a conversation: exactly one, before anything is read."""
    chat_flags = [flag for flag, given in (("--message", a.message), ("--messages", a.messages),
                                           ("--chat-template", a.chat_template)) if given]
    if a.chat and a.prompt is not None:
        raise DtmegaError("--prompt continues text; --chat answers a conversation. Fix: drop one (with --chat, the "
                          "question is --message user:TEXT)")
    if not a.chat and chat_flags:
        raise DtmegaError(f"{', '.join(chat_flags)} belong(s) to --chat. Fix: add --chat (or use --prompt TEXT)")
    if not a.chat and a.prompt is None:
        raise DtmegaError("nothing to generate from. Fix: --prompt TEXT, or --chat --message user:TEXT")


def chat_prompt(a: argparse.Namespace, head: CheckpointHead) -> tuple[str, tuple[int, ...], str]:
    """--chat's (rendered prompt, end-of-turn token ids, the line naming the template): the
    template and its special tokens chosen as `dtmega serve` chooses them, the conversation
    rendered with its generation prompt, all before any weight is read."""
    choice = choose_chat_template(a.chat_template, head)
    if choice.template is None:
        raise DtmegaError(f"--chat needs a chat template, and {head.checkpoint} keeps none (a model fine-tuned from a "
                          "Hugging Face chat model keeps its tokenizer's). Fix: --chat-template DIR|FILE.jinja (the "
                          "tokenizer directory or template the model was trained with)")
    messages = chat_messages(a.messages, a.message)
    prompt = choice.template.render(messages, add_generation_prompt=True)
    return prompt, end_of_turn_tokens(choice.template, head.tokenizer), choice.note


def main(argv: list[str]) -> str:
    """Prints and returns the continuation (--chat: the assistant's answer)."""
    a = build_parser().parse_args(argv)
    check_mode(a)
    if not 0 < a.top_p <= 1 or a.top_k < 0 or a.max_new_tokens < 1:
        raise DtmegaError("need 0 < --top-p <= 1, --top-k >= 0 and --max-new-tokens >= 1")
    if not 0 <= a.seed < 2**64:  # matrix 3, K6: a raw "Overflow when unpacking long long"
        raise DtmegaError(f"--seed {a.seed}: must be from 0 to 2^64 - 1 (torch's generator seeds). Fix: e.g. --seed 0")
    if not 0 <= a.temperature <= 100 or a.temperature != a.temperature:
        raise DtmegaError(f"--temperature {a.temperature}: must be 0 (greedy, as --greedy) or a positive number up to "
                          "100. Fix: e.g. --temperature 0.8")
    head = read_source_head(a, contents=False)
    prompt, stops, note = chat_prompt(a, head) if a.chat else (a.prompt, (), None)
    positions = check_request(head, prompt, a.max_new_tokens, "the rendered conversation" if a.chat else "the prompt")
    pm, tokenizer, _ = restore_with_progress(a.load, tp=a.tensor_model_parallel_size, custom_import=a.custom_import,
                                             load_hf=a.load_hf, tokenizer_model=a.tokenizer_model, positions=positions)
    if pm.program.facts.family not in decoding_families():
        raise DtmegaError(f"dtmega generate decodes {', '.join(decoding_families())} models (their KV cache); this "
                         f"checkpoint holds a {pm.program.facts.family} model. Fix: evaluate it with dtmega evaluate")
    pm.eval()
    dtype = next(pm.module.parameters()).dtype
    info = console(stderr=a.chat)  # --chat: stdout holds the answer alone, for scripts
    info.print(f"[dim]{describe_kv_cache(pm.module.config, a.tensor_model_parallel_size, dtype)}[/dim]",
               highlight=False)
    if note:
        info.print(note, style="dim", highlight=False, markup=False)
    with progress_bar("generate", total=a.max_new_tokens, unit="tokens") as bar:
        text = generate(pm.module, tokenizer, prompt, max_new_tokens=a.max_new_tokens,
                        temperature=0.0 if a.greedy else a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                        on_token=bar.advance, stop_tokens=stops)
    if a.chat:
        console().out(text, highlight=False)  # the answer alone, verbatim (no markup, emoji or wrapping): what scripts read
    else:
        console().print(f"[bold]{a.prompt}[/bold]{text}", highlight=False)
    return text
