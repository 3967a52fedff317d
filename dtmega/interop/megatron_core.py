"""Megatron-Core GPT checkpoints (`torch_dist`, written by `megatron.core.dist_checkpointing`)
as dtmega Llamas.

A torch_dist checkpoint is a PyTorch DCP checkpoint of global tensors, whatever TP/PP sizes
wrote it (each rank saved its shard at its global offset), so one process reads every tensor
whole with plain `torch.distributed.checkpoint`; megatron-core is not needed to convert. The
layout (megatron-core 0.16, `get_gpt_layer_local_spec` and the Transformer Engine spec alike):

    embedding.word_embeddings.weight                    [V, D]          tok_embeddings.weight
    decoder.layers.self_attention.linear_qkv.weight     [L, G*(H/G+2)*d, D]
        rows per query group g: its H/G query heads, then its key head, then its value head
    decoder.layers.self_attention.linear_qkv.layer_norm_weight [L, D]   attention_norm (folded in)
    decoder.layers.self_attention.linear_proj.weight    [L, D, H*d]     attention.wo
    decoder.layers.mlp.linear_fc1.weight                [L, 2F, D]      gate (w1) rows, then up (w3)
    decoder.layers.mlp.linear_fc1.layer_norm_weight     [L, D]          ffn_norm (folded in)
    decoder.layers.mlp.linear_fc2.weight                [L, D, F]       feed_forward.w2
    decoder.final_layernorm.weight                      [D]             norm
    output_layer.weight                                 [V, D]          output (absent: tied)

Layers are stacked on a leading dimension; checkpoints saved with `decoder.layers.<i>.` keys
(non-homogeneous layers) and separate `input_layernorm`/`pre_mlp_layernorm` weights are read
too. Megatron's RoPE rotates halves (rotate_half) unless `--rotary-interleaved`: the q/k rows
are reordered as for Hugging Face (hf_layout.hf_rows_to_dtmega). The checkpoint does not hold
the head counts or RoPE settings; they are the Megatron flags the run was trained with, checked
against the shapes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtmega.checkpoint_reader import load_dcp, read_dcp_metadata
from dtmega.kernels.errors import DtmegaError
from dtmega.models.llama.config import LlamaConfig, RopeScaling
from dtmega.models.llama.hf_names import hf_rows_to_dtmega

LAYERS = "decoder.layers."


class MegatronFormatError(DtmegaError):
    """A Megatron-Core checkpoint dtmega cannot convert as asked; names the key or flag."""


@dataclass(frozen=True)
class MegatronArchitecture:
    """What the checkpoint's shapes do not say: Megatron's flags of the run that wrote it."""

    num_attention_heads: int
    num_query_groups: int | None = None
    rotary_base: float = 10000.0
    rotary_interleaved: bool = False
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096


class MegatronCheckpoint:
    """A torch_dist checkpoint's tensor index, read whole tensor by tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / ".metadata").exists():
            raise MegatronFormatError(
                f"{self.path} has no .metadata: not a Megatron-Core torch_dist checkpoint (an iter_* directory "
                "written with --ckpt-format torch_dist). Fix: the iter_* directory itself")
        metadata = read_dcp_metadata(self.path).state_dict_metadata
        self.tensors = {key: meta for key, meta in metadata.items() if isinstance(meta, TensorStorageMetadata)}
        self.read_keys: set[str] = set()
        if any(".experts." in key or ".router." in key for key in self.tensors):
            raise MegatronFormatError(f"{self.path} holds a mixture-of-experts model; dtmega converts Megatron-Core "
                                      "dense GPT checkpoints (convert MoE models through Hugging Face's Mixtral)")

    def shape(self, key: str) -> tuple[int, ...]:
        """The global shape of `key`; an error naming it when the checkpoint lacks it."""
        if key not in self.tensors:
            raise MegatronFormatError(f"{self.path} has no tensor {key}; it is not a Megatron-Core GPT checkpoint "
                                      "(see docs/checkpoints.md for the keys read)")
        return tuple(self.tensors[key].size)

    def has(self, key: str) -> bool:
        return key in self.tensors

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor `key` in its stored dtype (one process, no process group)."""
        meta = self.tensors[key]
        self.read_keys.add(key)
        state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            load_dcp(state, self.path, no_dist=True)
        return state[key]

    def unread_weights(self) -> list[str]:
        """The model's weights (embedding, decoder, output layer) no read has taken: what a
        conversion would drop (TE's `_extra_state` and optimizer state are not weights)."""
        return sorted(key for key in self.tensors if key.startswith(("embedding.", "decoder.", "output_layer."))
                      and not key.endswith("_extra_state") and key not in self.read_keys)

    def layer_key(self, name: str, index: int) -> tuple[str, int | None]:
        """(key, index into its stacked layer dimension or None) of layer `index`'s `name`."""
        stacked = LAYERS + name
        if stacked in self.tensors:
            return stacked, index
        return f"{LAYERS}{index}.{name}", None


def layer_norm_key(checkpoint: MegatronCheckpoint, folded: str, separate: str) -> str:
    """A layer norm's key: Transformer Engine's name folded into the next linear layer when the
    checkpoint has it, else the local spec's own (input_layernorm, pre_mlp_layernorm)."""
    return folded if checkpoint.has(LAYERS + folded) or checkpoint.has(f"{LAYERS}0.{folded}") else separate


def llama_config_from_megatron(checkpoint: MegatronCheckpoint, arch: MegatronArchitecture) -> LlamaConfig:
    """The LlamaConfig of the checkpoint: sizes from its shapes, the rest from `arch`, checked."""
    vocab, dim = checkpoint.shape("embedding.word_embeddings.weight")
    if checkpoint.has(LAYERS + "mlp.linear_fc2.weight"):
        layers, _, ffn = checkpoint.shape(LAYERS + "mlp.linear_fc2.weight")
    else:
        layers = len({key.split(".")[2] for key in checkpoint.tensors if key.startswith(LAYERS)})
        ffn = checkpoint.shape(f"{LAYERS}0.mlp.linear_fc2.weight")[1]
    heads = arch.num_attention_heads
    groups = arch.num_query_groups or heads
    if dim % heads or heads % groups:
        raise MegatronFormatError(f"--num-attention-heads {heads} / --num-query-groups {groups} do not divide the "
                                  f"hidden size {dim} (from embedding.word_embeddings.weight) into whole heads")
    head_dim = dim // heads
    qkv_key, _ = checkpoint.layer_key("self_attention.linear_qkv.weight", 0)
    qkv_rows = checkpoint.shape(qkv_key)[-2]
    if qkv_rows != groups * (heads // groups + 2) * head_dim:
        raise MegatronFormatError(
            f"{qkv_key} has {qkv_rows} rows, but --num-attention-heads {heads} --num-query-groups {groups} give "
            f"{groups} x ({heads // groups} + 2) x {head_dim} = {groups * (heads // groups + 2) * head_dim}. Fix: the "
            "head counts the run was trained with")
    fc1_key, _ = checkpoint.layer_key("mlp.linear_fc1.weight", 0)
    if checkpoint.shape(fc1_key)[-2] != 2 * ffn:
        raise MegatronFormatError(f"{fc1_key} has {checkpoint.shape(fc1_key)[-2]} rows, not 2 x {ffn}: dtmega's "
                                  "Llama needs SwiGLU (--swiglu, gated linear units)")
    scaling = RopeScaling(factor=arch.rope_scaling_factor) if arch.use_rope_scaling else None
    return LlamaConfig(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=groups, vocab_size=vocab, ffn_dim=ffn,
                       norm_eps=arch.norm_epsilon, rope_theta=arch.rotary_base, rope_scaling=scaling,
                       max_seq_len=arch.max_position_embeddings,
                       tie_embeddings=not checkpoint.has("output_layer.weight"))


def dtmega_state_from_megatron(checkpoint: MegatronCheckpoint, config: LlamaConfig,
                               rotary_interleaved: bool = False) -> dict[str, torch.Tensor]:
    """Every dtmega tensor (fp32), read tensor by tensor from the checkpoint."""
    heads, groups, head_dim, ffn = config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim
    per_group = heads // groups
    out = {"tok_embeddings.weight": checkpoint.read("embedding.word_embeddings.weight").float(),
           "norm.weight": checkpoint.read("decoder.final_layernorm.weight").float()}
    if not config.tie_embeddings:
        out["output.weight"] = checkpoint.read("output_layer.weight").float()
    cache: dict[str, torch.Tensor] = {}

    def layer(name: str, index: int) -> torch.Tensor:
        key, position = checkpoint.layer_key(name, index)
        if key not in cache:
            cache.clear()  # one stacked tensor in memory at a time (layers are read in order per name)
            cache[key] = checkpoint.read(key)
        tensor = cache[key]
        return (tensor[position] if position is not None else tensor).float()

    attention_norm = layer_norm_key(checkpoint, "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
    ffn_norm = layer_norm_key(checkpoint, "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
    for name, fill in (
        (attention_norm, lambda t, p: {f"{p}.attention_norm.weight": t}),
        ("self_attention.linear_qkv.weight", lambda t, p: _split_qkv(t, p, heads, groups, head_dim, per_group,
                                                                     rotary_interleaved)),
        ("self_attention.linear_proj.weight", lambda t, p: {f"{p}.attention.wo.weight": t}),
        (ffn_norm, lambda t, p: {f"{p}.ffn_norm.weight": t}),
        ("mlp.linear_fc1.weight", lambda t, p: {f"{p}.feed_forward.w1.weight": t[:ffn].clone(),
                                                f"{p}.feed_forward.w3.weight": t[ffn:].clone()}),
        ("mlp.linear_fc2.weight", lambda t, p: {f"{p}.feed_forward.w2.weight": t}),
    ):
        for index in range(config.n_layers):
            out.update(fill(layer(name, index).clone(), f"layers.{index}"))
    return out


def _split_qkv(fused: torch.Tensor, prefix: str, heads: int, groups: int, head_dim: int, per_group: int,
               interleaved: bool) -> dict[str, torch.Tensor]:
    """Megatron's grouped [q heads of group g, k_g, v_g] rows as dtmega's wq, wk, wv."""
    blocks = fused.view(groups, (per_group + 2) * head_dim, -1)
    q = blocks[:, :per_group * head_dim].reshape(heads * head_dim, -1)
    k = blocks[:, per_group * head_dim:(per_group + 1) * head_dim].reshape(groups * head_dim, -1)
    v = blocks[:, (per_group + 1) * head_dim:].reshape(groups * head_dim, -1)
    if not interleaved:  # Megatron's default RoPE rotates halves, as Hugging Face's does
        q, k = hf_rows_to_dtmega(q, heads), hf_rows_to_dtmega(k, groups)
    return {f"{prefix}.attention.wq.weight": q.contiguous(), f"{prefix}.attention.wk.weight": k.contiguous(),
            f"{prefix}.attention.wv.weight": v.contiguous()}
