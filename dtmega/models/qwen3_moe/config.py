"""Qwen3-MoE's sizes as dtmega configs: Qwen3's attention (per-head q/k RMSNorm, head width 128,
RoPE base 1e6) with a mixture of experts in every block: no shared expert, softmax router with
top-k whose weights are renormalized to sum to one (`norm_topk_prob`; dtmega's `pre_softmax=False`
is that softmax over the k chosen logits), SwiGLU experts of `moe_intermediate_size`.

The sizes are the published `config.json`s of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the
Hugging Face Hub (read for their numbers; nothing here downloads). tests/unit/test_qwen3_moe.py
holds each size's parameter count to transformers' Qwen3MoeForCausalLM built from the same
numbers (30,532,122,624 and 235,093,634,560).
"""

from __future__ import annotations

from dtmega.models.llama.config import LlamaConfig
from dtmega.models.moe_config import MoEConfig
from dtmega.models.qwen3.config import HEAD_DIM, MAX_POSITIONS, VOCAB, qwen3_config

ROUTER_AUX_LOSS_COEF = 1e-3  # both published configs' router_aux_loss_coef


def qwen3_moe_config(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, experts: int, top_k: int,
                     expert_dim: int, *, dense_ffn_dim: int, norm_topk_prob: bool = True, vocab_size: int = VOCAB,
                     head_dim: int = HEAD_DIM, max_seq_len: int = MAX_POSITIONS, tie: bool = False,
                     aux_loss_coeff: float = ROUTER_AUX_LOSS_COEF) -> LlamaConfig:
    """A Qwen3-MoE config: Qwen3's attention and an MoE feed-forward in every block (the dense
    width `dense_ffn_dim`, HF's `intermediate_size`, is kept for blocks a config makes dense)."""
    moe = MoEConfig(num_experts=experts, top_k=top_k, ffn_dim=expert_dim, score_func="softmax",
                    pre_softmax=not norm_topk_prob, load_balancing="aux_loss", aux_loss_coeff=aux_loss_coeff)
    return qwen3_config(dim, n_layers, n_heads, dense_ffn_dim, tie=tie, n_kv_heads=n_kv_heads,
                        vocab_size=vocab_size, head_dim=head_dim, max_seq_len=max_seq_len).replace(moe=moe)


QWEN3_MOE_SIZES: dict[str, LlamaConfig] = {
    # hidden 2048, 48 layers, 32 query / 4 key-value heads, 128 experts of 768, top-8
    "qwen3-30b-a3b": qwen3_moe_config(2048, 48, 32, 4, 128, 8, 768, dense_ffn_dim=6144),
    # hidden 4096, 94 layers, 64 query / 4 key-value heads, 128 experts of 1536, top-8
    "qwen3-235b-a22b": qwen3_moe_config(4096, 94, 64, 4, 128, 8, 1536, dense_ffn_dim=12288),
    # tiny, for tests and examples: Qwen3-MoE's shape (head width apart from the width, 8 experts)
    "qwen3-moe-debug": qwen3_moe_config(64, 2, 4, 2, 8, 2, 32, dense_ffn_dim=128, vocab_size=256, head_dim=32,
                                        max_seq_len=2048),
}
