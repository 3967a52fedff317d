"""`dtmega generate`: sample from a checkpoint with a KV cache, on one rank or under TP.

    dtmega generate --load runs/demo/checkpoints --prompt "In the beginning"
    torchrun --nproc-per-node 2 -m dtmega generate --load ckpt --prompt "..." --tensor-model-parallel-size 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.tensor import DTensor

from dtmega.data.tokenizers import Tokenizer
from dtmega.models.kv_cache import KVCache
from dtmega.train.restore import restore


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]: greedy at temperature 0, else
    softmax sampling restricted to the top-k tokens and to the smallest set with mass top-p."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        mass = sorted_logits.softmax(-1).cumsum(-1)
        drop = mass - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int = 64,
             temperature: float = 0.8, top_k: int = 50, top_p: float = 0.95, seed: int = 0) -> str:
    """Continues `prompt`; stops at end-of-document or after `max_new_tokens`. Identical on every
    rank of a TP group (same seed, same gathered logits)."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("--prompt is empty after tokenization; give some text")
    device = next(model.buffers()).device
    vocab = tokenizer.vocab_size
    cache = KVCache(len(ids) + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([ids], device=device)
    produced: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens, cache=cache)[:, -1]
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logits[:, vocab:] = float("-inf")  # padded vocabulary rows are never real tokens
        next_id = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if int(next_id) == tokenizer.eod:
            break
        produced.append(int(next_id))
        tokens = next_id.view(1, 1)
    return tokenizer.decode(produced)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtmega generate", description="Sample text from a checkpoint.")
    p.add_argument("--load", required=True, help="checkpoint (a --save directory or an iter_* directory)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0 = no nucleus filter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    return p


def main(argv: list[str]) -> str:
    """Prints and returns the continuation."""
    a = build_parser().parse_args(argv)
    if not 0 < a.top_p <= 1 or a.top_k < 0 or a.max_new_tokens < 1:
        raise ValueError("need 0 < --top-p <= 1, --top-k >= 0 and --max-new-tokens >= 1")
    pm, tokenizer, _ = restore(a.load, tp=a.tensor_model_parallel_size)
    pm.eval()
    text = generate(pm.module, tokenizer, a.prompt, max_new_tokens=a.max_new_tokens,
                    temperature=0.0 if a.greedy else a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Console().print(f"[bold]{a.prompt}[/bold]{text}", highlight=False)
    return text
