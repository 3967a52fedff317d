"""Megatron-Core torch_dist checkpoints of Megatron's GPT blocks (LayerNorm, biases, a GeLU or
squared-ReLU MLP, learned or no positions, tied or untied) as dtmega GPTs.

The keys are the Llama-shaped checkpoint's (dtmega/interop/megatron_core.py) plus the biases:
`linear_qkv.bias` (rows per query group as the weight's), `linear_proj.bias`, `linear_fc1.bias`,
`linear_fc2.bias`, the norms' `layer_norm_bias` (or `input_layernorm.bias`/`pre_mlp_layernorm.bias`),
`decoder.final_layernorm.bias`, and `embedding.position_embeddings.weight` for learned positions.
A checkpoint is of this family when it holds any bias, learned positions or a non-gated MLP; what
its tensors cannot say (GeLU or squared ReLU, the GeLU's form, LayerNorm-1p) are Megatron's flags
of the run, as for the head counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtmega.interop.megatron_core import (
    LAYERS,
    MegatronArchitecture,
    MegatronCheckpoint,
    MegatronFormatError,
    layer_norm_key,
)
from dtmega.models.gpt.config import GPTConfig


@dataclass(frozen=True)
class GPTBlockFlags:
    """Megatron's flags of a GPT-block run that its checkpoint's tensors do not show."""

    squared_relu: bool = False
    no_bias_gelu_fusion: bool = False
    apply_layernorm_1p: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    rotary_percent: float = 1.0  # RoPE on the first int(head_dim x this) channels of each head


def is_gpt_checkpoint(checkpoint: MegatronCheckpoint) -> bool:
    """Whether the checkpoint holds Megatron's GPT blocks rather than a Llama-shaped model."""
    if checkpoint.has("embedding.position_embeddings.weight"):
        return True
    if any(key.endswith(("bias", "layer_norm_bias")) for key in checkpoint.tensors):
        return True
    fc1, _ = checkpoint.layer_key("mlp.linear_fc1.weight", 0)
    fc2, _ = checkpoint.layer_key("mlp.linear_fc2.weight", 0)
    return checkpoint.has(fc1) and checkpoint.has(fc2) and checkpoint.shape(fc1)[-2] == checkpoint.shape(fc2)[-1]


def _layers(checkpoint: MegatronCheckpoint) -> int:
    if checkpoint.has(LAYERS + "mlp.linear_fc2.weight"):
        return checkpoint.shape(LAYERS + "mlp.linear_fc2.weight")[0]
    return len({key.split(".")[2] for key in checkpoint.tensors if key.startswith(LAYERS)})


def gpt_config_from_megatron(checkpoint: MegatronCheckpoint, arch: MegatronArchitecture,
                             flags: GPTBlockFlags) -> GPTConfig:
    """The GPTConfig of the checkpoint: sizes, biases, norm kind, positions and tying from its
    tensors; heads and the rest from Megatron's flags, checked against the shapes."""
    vocab, dim = checkpoint.shape("embedding.word_embeddings.weight")
    heads, groups = arch.num_attention_heads, arch.num_query_groups or arch.num_attention_heads
    if dim % heads or heads % groups:
        raise MegatronFormatError(f"--num-attention-heads {heads} / --num-query-groups {groups} do not divide the "
                                  f"hidden size {dim} (from embedding.word_embeddings.weight) into whole heads")
    head_dim = dim // heads
    qkv_key, _ = checkpoint.layer_key("self_attention.linear_qkv.weight", 0)
    if checkpoint.shape(qkv_key)[-2] != groups * (heads // groups + 2) * head_dim:
        raise MegatronFormatError(
            f"{qkv_key} has {checkpoint.shape(qkv_key)[-2]} rows, but --num-attention-heads {heads} "
            f"--num-query-groups {groups} give {groups * (heads // groups + 2) * head_dim}. Fix: the head counts the "
            "run was trained with")
    fc1_key, _ = checkpoint.layer_key("mlp.linear_fc1.weight", 0)
    fc2_key, _ = checkpoint.layer_key("mlp.linear_fc2.weight", 0)
    ffn = checkpoint.shape(fc2_key)[-1]
    gated = checkpoint.shape(fc1_key)[-2] == 2 * ffn
    bias_key, _ = checkpoint.layer_key("self_attention.linear_proj.bias", 0)
    qkv_bias_key, _ = checkpoint.layer_key("self_attention.linear_qkv.bias", 0)
    layer_norm = checkpoint.has("decoder.final_layernorm.bias")
    learned = checkpoint.has("embedding.position_embeddings.weight")
    positions = checkpoint.shape("embedding.position_embeddings.weight")[0] if learned else arch.max_position_embeddings
    activation = "swiglu" if gated else "squared_relu" if flags.squared_relu else "gelu"
    qk_norm_key, _ = checkpoint.layer_key("self_attention.q_layernorm.weight", 0)
    return GPTConfig(
        dim=dim, n_layers=_layers(checkpoint), n_heads=heads, n_kv_heads=groups, vocab_size=vocab, ffn_dim=ffn,
        max_seq_len=positions, normalization="LayerNorm" if layer_norm else "RMSNorm",
        layernorm_1p=flags.apply_layernorm_1p, norm_eps=arch.norm_epsilon,
        position_embedding="learned_absolute" if learned else "rope", rope_theta=arch.rotary_base,
        bias=checkpoint.has(bias_key), qkv_bias=checkpoint.has(qkv_bias_key), activation=activation,
        gelu_approximate="none" if flags.no_bias_gelu_fusion or not checkpoint.has(bias_key) else "tanh",
        attention_dropout=flags.attention_dropout, hidden_dropout=flags.hidden_dropout,
        tie_embeddings=not checkpoint.has("output_layer.weight"), qk_norm=checkpoint.has(qk_norm_key),
        rotary_percent=flags.rotary_percent,
    )


def gpt_state_from_megatron(checkpoint: MegatronCheckpoint, config: GPTConfig,
                            rotary_interleaved: bool = False) -> dict[str, torch.Tensor]:
    """Every dtmega GPT tensor (fp32), read tensor by tensor from the checkpoint."""
    from dtmega.models.llama.hf_names import hf_rows_to_dtmega

    heads, groups, head_dim, ffn = config.n_heads, config.kv_heads, config.head_dim, config.hidden_ffn
    per_group = heads // groups
    reorder = config.position_embedding == "rope" and not rotary_interleaved  # Megatron's RoPE rotates halves

    def read(key: str) -> torch.Tensor:
        return checkpoint.read(key).float()

    def rotated_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
        """A q/k projection's rows, each head's rotated channels (--rotary-percent's first share)
        from Megatron's half-split order into dtmega's interleaved pairs; the rest as they are."""
        rotated = config.rotary_dim
        per_head = rows.reshape(count, head_dim, -1)
        moved = hf_rows_to_dtmega(per_head[:, :rotated].reshape(count * rotated, -1), count)
        return torch.cat([moved.reshape(count, rotated, -1), per_head[:, rotated:]], dim=1).reshape(rows.shape)

    out = {"embedding.word.weight": read("embedding.word_embeddings.weight")}
    if config.position_embedding == "learned_absolute":
        out["embedding.position.weight"] = read("embedding.position_embeddings.weight")
    out["norm.weight"] = read("decoder.final_layernorm.weight")
    if config.normalization == "LayerNorm":
        out["norm.bias"] = read("decoder.final_layernorm.bias")
    if not config.tie_embeddings:
        out["output.weight"] = read("output_layer.weight")

    def qkv(fused: torch.Tensor, prefix: str, kind: str) -> dict[str, torch.Tensor]:
        blocks = fused.reshape(groups, (per_group + 2) * head_dim, -1)
        q = blocks[:, :per_group * head_dim].reshape(heads * head_dim, -1)
        k = blocks[:, per_group * head_dim:(per_group + 1) * head_dim].reshape(groups * head_dim, -1)
        v = blocks[:, (per_group + 1) * head_dim:].reshape(groups * head_dim, -1)
        if reorder:
            q, k = rotated_rows(q, heads), rotated_rows(k, groups)
        shaped = (lambda t: t.reshape(-1)) if kind == "bias" else (lambda t: t)
        return {f"{prefix}.attention.w{n}.{kind}": shaped(t).contiguous() for n, t in (("q", q), ("k", k), ("v", v))}

    def split_fc1(tensor: torch.Tensor, prefix: str, kind: str) -> dict[str, torch.Tensor]:
        if config.activation == "swiglu":  # gate rows, then up rows
            return {f"{prefix}.feed_forward.w1.{kind}": tensor[:ffn].clone(),
                    f"{prefix}.feed_forward.w3.{kind}": tensor[ffn:].clone()}
        return {f"{prefix}.feed_forward.w1.{kind}": tensor}

    names = [
        (layer_norm_key(checkpoint, "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
         lambda t, p: {f"{p}.attention_norm.weight": t}),
        (layer_norm_key(checkpoint, "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
         lambda t, p: {f"{p}.ffn_norm.weight": t}),
        ("self_attention.linear_qkv.weight", lambda t, p: qkv(t, p, "weight")),
        ("self_attention.linear_proj.weight", lambda t, p: {f"{p}.attention.wo.weight": t}),
        ("mlp.linear_fc1.weight", lambda t, p: split_fc1(t, p, "weight")),
        ("mlp.linear_fc2.weight", lambda t, p: {f"{p}.feed_forward.w2.weight": t}),
    ]
    if config.normalization == "LayerNorm":
        names += [
            (layer_norm_key(checkpoint, "self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
             lambda t, p: {f"{p}.attention_norm.bias": t}),
            (layer_norm_key(checkpoint, "mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
             lambda t, p: {f"{p}.ffn_norm.bias": t}),
        ]
    if config.has_qkv_bias:
        names.append(("self_attention.linear_qkv.bias", lambda t, p: qkv(t[:, None], p, "bias")))

    def head_vector(tensor: torch.Tensor) -> torch.Tensor:  # a q/k norm's [head_dim] in dtmega's channel order
        return rotated_rows(tensor[:, None], 1)[:, 0].contiguous() if reorder else tensor

    if config.qk_norm:  # --qk-layernorm: the block's norm kind on each head, weights (and biases) [head_dim]
        for kind in ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",):
            names += [(f"self_attention.q_layernorm.{kind}",
                       lambda t, p, kind=kind: {f"{p}.attention.q_norm.{kind}": head_vector(t)}),
                      (f"self_attention.k_layernorm.{kind}",
                       lambda t, p, kind=kind: {f"{p}.attention.k_norm.{kind}": head_vector(t)})]
    if config.bias:
        names += [("self_attention.linear_proj.bias", lambda t, p: {f"{p}.attention.wo.bias": t}),
                  ("mlp.linear_fc1.bias", lambda t, p: split_fc1(t, p, "bias")),
                  ("mlp.linear_fc2.bias", lambda t, p: {f"{p}.feed_forward.w2.bias": t})]
    for name, fill in names:  # name by name: one stacked tensor in memory at a time
        stacked: dict[str, torch.Tensor] = {}
        for index in range(config.n_layers):
            key, position = checkpoint.layer_key(name, index)
            if key not in stacked:
                stacked = {key: read(key)}
            tensor = stacked[key]
            out.update(fill((tensor[position] if position is not None else tensor).clone(), f"layers.{index}"))
    return out
