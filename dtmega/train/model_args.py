"""The model section of `dtmega train`'s arguments: a registered name or Megatron's size flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dtmega.models.llama.config import NAMED_CONFIGS
from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ModelArgs:
    """The model: a registered name or Megatron's size flags, and what the family's config takes."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("num_layers", "hidden_size", "ffn_hidden_size",
        "num_attention_heads", "num_query_groups", "seq_length", "max_position_embeddings",
        "make_vocab_size_divisible_by", "kv_channels", "padded_vocab_size", "rotary_seq_len_interpolation_factor")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("attention_dropout", "hidden_dropout")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("init_method_std", "norm_epsilon", "rotary_base", "rotary_percent")

    model: str | None = _opt(None, "a registered model: " + ", ".join(NAMED_CONFIGS) + ", or one of your own "
                                   "(dtmega.models.register_model in a --custom-import module)")
    custom_import: list[str] = _opt([], "Python modules to import first (they register models, families, passes)")
    num_layers: int | None = _opt(None, "transformer blocks")
    hidden_size: int | None = _opt(None, "model width")
    ffn_hidden_size: int | None = _opt(None, "MLP width (default: Megatron's SwiGLU rule, 8/3 x hidden, multiple of 64)")
    num_attention_heads: int | None = _opt(None, "attention heads")
    group_query_attention: bool = _opt(False, "use grouped-query attention (with --num-query-groups)")
    num_query_groups: int | None = _opt(None, "key/value heads under --group-query-attention")
    seq_length: int = _opt(1024, "tokens per sample")
    max_position_embeddings: int | None = _opt(None, "position table length (default: --seq-length)")
    init_method_std: float = _opt(0.02, "std of the normal init")
    untie_embeddings_and_output_weights: bool = _opt(False, "separate input embedding and output layer")
    swiglu: bool = _opt(False, "SwiGLU MLP (without it, Megatron's GPT blocks: a GeLU MLP)")
    squared_relu: bool = _opt(False, "squared-ReLU MLP (GPT blocks)")
    no_bias_gelu_fusion: bool = _opt(False, "exact (erf) GeLU; Megatron's fused bias-GeLU, the default, is the tanh form")
    disable_bias_linear: bool = _opt(False, "no biases on the linear layers (Megatron's default: biases)")
    add_bias_linear: bool = _opt(False, "biases on every linear layer (Megatron's default, said explicitly)")
    add_qkv_bias: bool = _opt(False, "biases on the query, key and value projections only (with --disable-bias-linear)")
    normalization: str = _opt("LayerNorm", "norm layer (Megatron's default: LayerNorm)", ("RMSNorm", "LayerNorm"))
    norm_epsilon: float = _opt(1e-5, "norm epsilon")
    position_embedding_type: str = _opt("learned_absolute", "position embedding (Megatron's default: learned_absolute; "
                                                            "yarn is not supported yet)",
                                        ("rope", "learned_absolute", "none", "yarn"))
    rotary_base: float = _opt(10000.0, "RoPE theta")
    rotary_percent: float = _opt(1.0, "share of each head's dimensions RoPE rotates (below 1: Megatron's partial "
                                      "rotary, on GPT blocks)")
    kv_channels: int | None = _opt(None, "width of each attention head (default --hidden-size / --num-attention-heads; "
                                         "Qwen3: 128)")
    qk_layernorm: bool = _opt(False, "RMSNorm on each query and key head before RoPE (Qwen3's attention; with "
                                     "--multi-latent-attention, DeepSeek's latent norms)")
    apply_layernorm_1p: bool = _opt(False, "norm weights stored zero-centred, applied as (1 + w) (GPT blocks)")
    use_rope_scaling: bool = _opt(False, "Llama-3.1 RoPE frequency scaling")
    make_vocab_size_divisible_by: int = _opt(128, "pad the vocabulary to a multiple of this x TP size")
    padded_vocab_size: int | None = _opt(None, "the model's vocabulary size exactly (at least the tokenizer's, a "
                                               "multiple of TP), instead of the padding --make-vocab-size-divisible-by "
                                               "computes")
    rotary_seq_len_interpolation_factor: int | None = _opt(None, "RoPE position interpolation: positions divided by "
                                                                 "this (only 1 is supported)")
    attention_dropout: float = _opt(0.1, "dropout on attention probabilities (Megatron's default 0.1; GPT blocks)")
    hidden_dropout: float = _opt(0.1, "dropout on the embedding and residual branches (Megatron's default 0.1; GPT "
                                      "blocks)")
