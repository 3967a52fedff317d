"""`dtmega generate`: sample from a checkpoint with a KV cache, on one rank or under TP.

    dtmega generate --load runs/demo/checkpoints --prompt "In the beginning"
    torchrun --nproc-per-node 2 -m dtmega generate --load ckpt --prompt "..." --tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from dtmega.data.tokenizers import Tokenizer
from dtmega.kernels.errors import DtmegaError
from dtmega.models.kv_cache import DECODING_FAMILIES, KVCache
from dtmega.printing import console
from dtmega.progress import progress_bar
from dtmega.serve.kv_budget import describe_kv_cache
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
                    seed: int = 0, on_token: Callable[[], None] | None = None) -> Generation:
    """Continues `prompt_ids` with a KV cache; stops at `eod` or after `max_new_tokens`.
    Identical on every rank of a TP group (same seed, same gathered logits). `on_token()` after
    each chosen token (a progress bar's `advance`)."""
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
        if next_id == eod:
            break
        result.ids.append(next_id)
        tokens = choice.ids.view(1, 1)
    return result


def generate(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int = 64,
             temperature: float = 0.8, top_k: int = 50, top_p: float = 0.95, seed: int = 0,
             on_token: Callable[[], None] | None = None) -> str:
    """Continues `prompt` (text in, text out); see `generate_tokens`."""
    produced = generate_tokens(model, tokenizer.encode(prompt), vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
                               max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, on_token=on_token)
    return tokenizer.decode(produced.ids)


def check_request(head: CheckpointHead, prompt: str, max_new_tokens: int) -> None:
    """The prompt is text (UTF-8) and prompt + new tokens fit the model's context, checked from
    the checkpoint's files before any weight is loaded or KV cache allocated."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DtmegaError(f"--prompt holds bytes that are not UTF-8 text (from character {error.start}: "
                         f"{prompt[error.start:error.end]!r}). Fix: pass the prompt as UTF-8") from None
    context = getattr(head.config, "max_seq_len", None)
    used = len(head.tokenizer.encode(prompt))
    if context is not None and used + max_new_tokens > context:
        raise DtmegaError(
            f"the prompt ({used} tokens) + --max-new-tokens {max_new_tokens} = {used + max_new_tokens} tokens exceeds "
            f"the model's context of {context} tokens (its max position embeddings). Fix: --max-new-tokens "
            f"{max(context - used, 0)} or less" + (", and a shorter prompt" if used >= context else "")
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega generate", description="Sample text from a checkpoint.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_source(p)
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0 = no nucleus filter")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (launch that many ranks)")
    p.add_argument("--custom-import", nargs="+", default=[], help="modules that register the checkpoint's model")
    return p


def main(argv: list[str]) -> str:
    """Prints and returns the continuation."""
    a = build_parser().parse_args(argv)
    if not 0 < a.top_p <= 1 or a.top_k < 0 or a.max_new_tokens < 1:
        raise DtmegaError("need 0 < --top-p <= 1, --top-k >= 0 and --max-new-tokens >= 1")
    if not 0 <= a.temperature <= 100 or a.temperature != a.temperature:
        raise DtmegaError(f"--temperature {a.temperature}: must be 0 (greedy, as --greedy) or a positive number up to "
                          "100. Fix: e.g. --temperature 0.8")
    check_request(read_source_head(a, contents=False), a.prompt, a.max_new_tokens)
    pm, tokenizer, _ = restore_with_progress(a.load, tp=a.tensor_model_parallel_size, custom_import=a.custom_import,
                                             load_hf=a.load_hf)
    if pm.program.facts.family not in DECODING_FAMILIES:
        raise DtmegaError(f"dtmega generate decodes {' and '.join(DECODING_FAMILIES)} models (their KV cache); this "
                         f"checkpoint holds a {pm.program.facts.family} model. Fix: evaluate it with dtmega evaluate")
    pm.eval()
    dtype = next(pm.module.parameters()).dtype
    console().print(f"[dim]{describe_kv_cache(pm.module.config, a.tensor_model_parallel_size, dtype)}[/dim]",
                    highlight=False)
    with progress_bar("generate", total=a.max_new_tokens, unit="tokens") as bar:
        text = generate(pm.module, tokenizer, a.prompt, max_new_tokens=a.max_new_tokens,
                        temperature=0.0 if a.greedy else a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                        on_token=bar.advance)
    console().print(f"[bold]{a.prompt}[/bold]{text}", highlight=False)
    return text
