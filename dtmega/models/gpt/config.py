"""Configuration of the GPT family (Megatron's GPT blocks, GPT-2, GPT-3) and its named sizes.

Every field is one of Megatron's model flags, with Megatron's default when the flag is absent
(`dtmega/models/gpt/megatron.py` maps them): LayerNorm, learned absolute positions, biases on
every linear layer, a GeLU MLP four times as wide, dropout 0.1 on attention probabilities and on
the residual branches, and the output layer tied to the word embedding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtmega.kernels.errors import DtmegaError
from dtmega.models.config_checks import number_problems
from dtmega.models.moe_config import MoEConfig

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITIONS = ("learned_absolute", "rope", "none")
ACTIVATIONS = ("gelu", "swiglu", "squared_relu")


@dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of one GPT-family decoder."""

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # key/value heads (query groups); None: one per query head
    vocab_size: int = 50304
    ffn_dim: int | None = None  # None: 4 x dim (Megatron's default for a GeLU MLP)
    max_seq_len: int = 1024  # learned position table rows (or the RoPE table's)
    normalization: str = "LayerNorm"
    layernorm_1p: bool = False  # norm weights stored zero-centred, applied as (1 + w)
    norm_eps: float = 1e-5
    position_embedding: str = "learned_absolute"
    rope_theta: float = 10000.0
    rotary_percent: float = 1.0  # --rotary-percent: RoPE on the first int(head_dim x this) channels of each head
    bias: bool = True  # --add-bias-linear (Megatron's default) / --disable-bias-linear
    qkv_bias: bool | None = None  # None: as `bias`; --add-qkv-bias puts biases on q, k, v only
    activation: str = "gelu"
    # GeLU's form: "tanh" is Megatron's fused bias-GeLU (its default; GPT-2's gelu_new), "none"
    # the exact erf form (Megatron with --no-bias-gelu-fusion)
    gelu_approximate: str = "tanh"
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    tie_embeddings: bool = True
    init_std: float = 0.02
    kv_channels: int | None = None  # head width when it is not dim / n_heads
    qk_norm: bool = False  # --qk-layernorm: the block's norm kind on each query and key head, before RoPE
    # --num-experts: MoE blocks whose experts are this block's MLP kind without biases (GeLU
    # experts for GPT blocks, as Megatron builds them; Megatron's grouped experts carry no biases here)
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:  # one key/value head per query head
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        problems = []
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_channels is None and self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            problems.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            problems.append(f"ffn_dim must be positive, got {self.ffn_dim}")
        for name, allowed in (("normalization", NORMALIZATIONS), ("position_embedding", POSITIONS),
                              ("activation", ACTIVATIONS), ("gelu_approximate", ("tanh", "none"))):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.moe is not None and self.moe.activation != self.activation:
            problems.append(f"the experts' activation {self.moe.activation!r} differs from the blocks' "
                            f"{self.activation!r} (Megatron's experts use the model's activation)")
        if self.position_embedding == "rope" and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        if not 0.0 < self.rotary_percent <= 1.0 or (self.position_embedding == "rope" and
                                                     (self.rotary_dim <= 0 or self.rotary_dim % 2)):
            problems.append(f"rotary_percent={self.rotary_percent} must be in (0, 1] and rotate an even, positive "
                            f"number of each head's {self.head_dim} channels (int(head_dim x rotary_percent) = "
                            f"{int(self.head_dim * self.rotary_percent)})")
        problems += number_problems(self, positive=("rope_theta", "norm_eps"), non_negative=("init_std",))
        if problems:
            raise DtmegaError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Width of one attention head: kv_channels, else dim / n_heads."""
        return self.kv_channels if self.kv_channels is not None else self.dim // max(1, self.n_heads)

    @property
    def rotary_dim(self) -> int:
        """Channels of each head RoPE rotates (Megatron: int(kv_channels x rotary_percent)); the
        rest pass through unrotated."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def kv_heads(self) -> int:
        """Key/value heads (query groups)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_ffn(self) -> int:
        """The MLP's hidden width (per gate for SwiGLU)."""
        return self.ffn_dim if self.ffn_dim is not None else 4 * self.dim

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the q, k, v projections carry biases."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def replace(self, **changes) -> "GPTConfig":
        """A copy with some fields changed (configs are frozen so plans can hash them)."""
        return dataclasses.replace(self, **changes)

    def norm_params(self) -> int:
        """Parameters of one norm layer (LayerNorm: weight and bias; RMSNorm: weight)."""
        return self.dim * (2 if self.normalization == "LayerNorm" else 1)

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` has a mixture of experts instead of the MLP."""
        return self.moe is not None and self.moe.is_moe_layer(index)

    def layer_params(self, index: int = 0) -> int:
        """Parameters of block `index`: two norms, attention, MLP (or experts), with their biases."""
        hd, q, kv = self.head_dim, self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.dim * (q + 2 * kv) + q * self.dim
        attention += (q + 2 * kv) * self.has_qkv_bias + self.dim * self.bias
        attention += 2 * hd * (2 if self.normalization == "LayerNorm" else 1) * self.qk_norm
        gates = 2 if self.activation == "swiglu" else 1
        mlp = gates * self.dim * self.hidden_ffn + self.hidden_ffn * self.dim
        mlp += (gates * self.hidden_ffn + self.dim) * self.bias
        if self.is_moe_layer(index):
            mlp = self.moe.params_per_layer(self.dim)
        return 2 * self.norm_params() + attention + mlp

    def num_params(self) -> int:
        """Exact parameter count, computed from the shapes alone (Megatron's count for the same
        flags: word embedding, learned positions, blocks, final norm, an untied output layer)."""
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        positions = self.max_seq_len * self.dim if self.position_embedding == "learned_absolute" else 0
        blocks = sum(self.layer_params(i) for i in range(self.n_layers))
        return embeddings + positions + blocks + self.norm_params()

    def num_active_params(self) -> int:
        """Parameters one token passes through (MoE: its top_k experts, not all of them)."""
        if self.moe is None:
            return self.num_params()
        moe = self.moe
        idle = moe.expert_matrices * self.dim * moe.ffn_dim * (moe.num_experts - moe.top_k)
        return self.num_params() - idle * sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPTConfig":
        """A named size (GPT_SIZES), optionally overridden."""
        if name not in GPT_SIZES:
            raise KeyError(f"unknown GPT config {name!r}; known: {', '.join(sorted(GPT_SIZES))}")
        return dataclasses.replace(GPT_SIZES[name], **overrides)


GPT_SIZES: dict[str, GPTConfig] = {
    # GPT-2 small and medium as Megatron trains them from GPT-2's vocab/merges: 50,257 tokens
    # padded to 50,304 (--make-vocab-size-divisible-by 128), 1,024 positions, tied output.
    "gpt2-124m": GPTConfig(dim=768, n_layers=12, n_heads=12, vocab_size=50304, max_seq_len=1024),
    "gpt2-medium": GPTConfig(dim=1024, n_layers=24, n_heads=16, vocab_size=50304, max_seq_len=1024),
    # Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh: 96 x 12,288, 96 heads, 2,048
    # positions, GPT-2's vocabulary padded for TP 8 (128 x 8 = 1,024: 51,200 rows), init std 0.006.
    "gpt3-175b": GPTConfig(dim=12288, n_layers=96, n_heads=96, vocab_size=51200, max_seq_len=2048, init_std=0.006),
    # Tiny, for tests and examples: every size divides TP=4 and the 4 layers split over PP=4.
    "gpt-debug": GPTConfig(dim=64, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=512),
}
