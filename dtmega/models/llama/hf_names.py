"""Where each dtmega weight lives in a Hugging Face Llama/Mixtral checkpoint, and the one layout
difference between them: the order of the query/key channels that RoPE rotates together.

dtmega's RoPE (like Meta's reference Llama) rotates adjacent channel pairs (2i, 2i+1) of each
head; Hugging Face's `rotate_half` rotates channel i with channel i + head_dim/2. The two models
compute the same attention when the rows of `q_proj`/`k_proj` are permuted inside each head:

    dtmega row 2i + p of a head  <->  HF row p * head_dim/2 + i      (p = 0 or 1)

This is the only place that permutation is written (`hf_rows_to_dtmega`, `dtmega_rows_to_hf`);
the reader, the exporter and the tests use it. It moves whole rows within a head, so a rank that
owns a range of rows (tensor parallelism splits heads; FSDP splits rows anywhere) reads the
heads that range touches and keeps its rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from dtmega.models.llama.config import LlamaConfig


@dataclass(frozen=True)
class WeightSource:
    """Where one dtmega tensor comes from: `names` (one HF tensor, or with `stacked` one per
    expert, stacked on dim 0), `heads` > 0 when the rows are reordered within heads of
    `head_dim` rows: `reorder(block of whole heads, number of heads)` gives them in dtmega's
    order (default: RoPE's half-split rows into pairs, `hf_rows_to_dtmega`)."""

    names: tuple[str, ...]
    heads: int = 0
    head_dim: int = 0
    reorder: Callable[[torch.Tensor, int], torch.Tensor] | None = None
    stacked: bool = False
    # GPT-2's Conv1D layers store [in, out] (`transpose`) and fuse q, k, v in one tensor: dtmega's
    # rows start at `offset` of the HF tensor's output dim; `hf_shape` is the HF tensor's shape
    transpose: bool = False
    offset: int = 0
    hf_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.heads and self.reorder is None:
            object.__setattr__(self, "reorder", hf_rows_to_dtmega)


@dataclass(frozen=True)
class HFPart:
    """One piece of an HF tensor that several dtmega tensors fill (GPT-2's fused q/k/v `c_attn`):
    piece `index` of `count`, concatenated along `dim` on export."""

    index: int
    count: int
    dim: int
    tensor: torch.Tensor


def hf_rows_to_dtmega(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of an HF q/k projection [heads * head_dim, in] in dtmega's (interleaved-pair) order."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def dtmega_rows_to_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `hf_rows_to_dtmega`: dtmega's q/k rows in Hugging Face's (half-split) order."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# dtmega name (layer index as {i}) -> HF name. Mixtral's experts and router are handled below.
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "block_sparse_moe.gate.weight",
}
_EXPERTS = {"feed_forward.experts.w1": "w1", "feed_forward.experts.w2": "w2", "feed_forward.experts.w3": "w3"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")

# The tables of docs/checkpoints.md, generated from the mapping above.
NAME_TABLE = [(f"layers.{{i}}.{ours}", f"model.layers.{{i}}.{theirs}") for ours, theirs in _BLOCK.items()] + [
    (f"layers.{{i}}.{ours}[e]", f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{theirs}.weight")
    for ours, theirs in _EXPERTS.items()
] + [(ours, theirs) for ours, theirs in _TOP.items()]


def top_level_source(name: str, tied: bool, hf_names: set[str] | None = None) -> WeightSource | None:
    """Where the embedding, final norm and output layer come from in an HF decoder checkpoint
    (None for any other name): a tied model's output layer, or one whose checkpoint has no
    `lm_head` (transformers does not write a tied copy), is read from the embedding."""
    if name not in _TOP:
        return None
    hf = _TOP[name]
    if name == "output.weight" and (tied or (hf_names is not None and hf not in hf_names)):
        hf = _TOP["tok_embeddings.weight"]
    return WeightSource((hf,))


def hf_source(name: str, config: LlamaConfig, hf_names: set[str] | None = None) -> WeightSource:
    """The HF tensor(s) dtmega's `name` is read from (`hf_names`: the checkpoint's tensors, to
    find a tied `lm_head`). KeyError for a name with no HF counterpart."""
    top = top_level_source(name, config.tie_embeddings, hf_names)
    if top is not None:
        return top
    match = _LAYER.fullmatch(name)
    if match is None:
        raise KeyError(name)
    index, rest = match.groups()
    prefix = f"model.layers.{index}."
    if rest in _EXPERTS:
        experts = config.moe.num_experts
        return WeightSource(tuple(f"{prefix}block_sparse_moe.experts.{e}.{_EXPERTS[rest]}.weight"
                                  for e in range(experts)), stacked=True)
    if rest not in _BLOCK:
        raise KeyError(name)
    if rest == "attention.wq.weight":
        return WeightSource((prefix + _BLOCK[rest],), config.n_heads, config.head_dim)
    if rest == "attention.wk.weight":
        return WeightSource((prefix + _BLOCK[rest],), config.n_kv_heads, config.head_dim)
    return WeightSource((prefix + _BLOCK[rest],))


def hf_tensors(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """dtmega's full tensor `name` as the HF tensors it becomes (export); a tied output is
    written once, as the embedding."""
    if name == "output.weight" and config.tie_embeddings:
        return {}
    source = hf_source(name, config)
    if source.stacked:
        return {hf: tensor[e] for e, hf in enumerate(source.names)}
    if source.heads:
        return {source.names[0]: dtmega_rows_to_hf(tensor, source.heads)}
    return {source.names[0]: tensor}
