"""Qwen3's dense sizes as dtmega configs: Llama's decoder with per-head RMSNorm on queries and
keys (`qk_norm`), a head width of its own (`kv_channels` = head_dim 128 at every size, not
hidden / heads), RoPE base 1e6, and the embedding tied to the output on the small sizes.

The sizes are the published `config.json`s of Qwen/Qwen3-0.6B ... Qwen3-32B on the Hugging
Face Hub (read for their numbers; nothing here downloads). tests/unit/test_qwen3.py holds every
size's parameter count to transformers' Qwen3ForCausalLM built from the same numbers.
"""

from __future__ import annotations

from dtmega.models.llama.config import LlamaConfig

VOCAB = 151936
HEAD_DIM = 128
MAX_POSITIONS = 40960


def qwen3_config(dim: int, n_layers: int, n_heads: int, ffn_dim: int, *, tie: bool, n_kv_heads: int = 8,
                 vocab_size: int = VOCAB, head_dim: int = HEAD_DIM, max_seq_len: int = MAX_POSITIONS) -> LlamaConfig:
    """A Qwen3 dense config: Llama's fields with Qwen3's q/k norms, head width, RoPE base and eps."""
    return LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab_size,
                       ffn_dim=ffn_dim, norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=max_seq_len,
                       tie_embeddings=tie, qk_norm=True, kv_channels=head_dim)


# name -> (hidden, layers, heads, intermediate, tied), as in each model's config.json
_PUBLISHED = {
    "qwen3-0.6b": (1024, 28, 16, 3072, True),
    "qwen3-1.7b": (2048, 28, 16, 6144, True),
    "qwen3-4b": (2560, 36, 32, 9728, True),
    "qwen3-8b": (4096, 36, 32, 12288, False),
    "qwen3-14b": (5120, 40, 40, 17408, False),
    "qwen3-32b": (5120, 64, 64, 25600, False),
}

QWEN3_SIZES: dict[str, LlamaConfig] = {
    name: qwen3_config(dim, layers, heads, ffn, tie=tie) for name, (dim, layers, heads, ffn, tie) in _PUBLISHED.items()
}
# A tiny size for tests and examples: Qwen3's shape (head_dim independent of the width, tied).
QWEN3_SIZES["qwen3-debug"] = qwen3_config(64, 2, 4, 128, tie=True, n_kv_heads=2, vocab_size=256, head_dim=32,
                                          max_seq_len=2048)
