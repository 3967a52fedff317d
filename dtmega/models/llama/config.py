"""Configuration of the reference Llama and its named sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dtmega.kernels.errors import DtmegaError
from dtmega.models.config_checks import number_problems
from dtmega.models.moe_config import MoEConfig


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 frequency scaling of RoPE (stretches long wavelengths for long context)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family decoder: GQA attention, RoPE, SwiGLU MLP, RMSNorm."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: MoEConfig | None = None  # mixture-of-experts feed-forwards (None: every block dense)
    # Per-head RMSNorm on queries and keys before RoPE (Qwen3; Megatron's --qk-layernorm)
    qk_norm: bool = False
    # Width of one attention head when it is not dim / n_heads (Qwen3; Megatron's --kv-channels)
    kv_channels: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.kv_channels is None and self.dim % self.n_heads:
            problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.kv_channels is not None and self.kv_channels <= 0:
            problems.append(f"kv_channels must be positive, got {self.kv_channels}")
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads} "
                "(every query group needs the same number of heads)"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        problems += number_problems(self, positive=("rope_theta", "norm_eps"), non_negative=("init_std",))
        if self.rope_scaling is not None:
            problems += [f"rope_scaling.{line}" for line in number_problems(
                self.rope_scaling, positive=("low_freq_factor", "high_freq_factor", "original_max_seq_len"),
                at_least_one=("factor",))]
        if problems:
            raise DtmegaError("invalid LlamaConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """Width of one attention head: kv_channels, else dim / n_heads."""
        return self.kv_channels if self.kv_channels is not None else self.dim // max(1, self.n_heads)

    def replace(self, **changes) -> "LlamaConfig":
        """A copy with some fields changed (configs are frozen so plans can hash them)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Exact parameter count, computed from the shapes alone (no model is built)."""
        hd = self.head_dim
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2 + (2 * hd if self.qk_norm else 0)
        layers = 0
        for index in range(self.n_layers):
            if self.moe is not None and self.moe.is_moe_layer(index):
                layers += attn + self.moe.params_per_layer(self.dim) + 2 * self.dim
            else:
                layers += attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + layers + self.dim

    def num_active_params(self) -> int:
        """Parameters one token passes through (MoE: top_k routed experts, not all of them);
        what FLOPs per token are counted from."""
        if self.moe is None:
            return self.num_params()
        moe = self.moe
        idle = 3 * self.dim * moe.ffn_dim * (moe.num_experts - moe.top_k)
        return self.num_params() - idle * sum(moe.is_moe_layer(i) for i in range(self.n_layers))

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LlamaConfig":
        """A named size (`debug`, `llama3-8b`, `llama3-70b`, `llama3-405b`), optionally overridden."""
        if name not in NAMED_CONFIGS:
            raise KeyError(f"unknown Llama config {name!r}; known: {', '.join(sorted(NAMED_CONFIGS))}")
        return dataclasses.replace(NAMED_CONFIGS[name], **overrides)


NAMED_CONFIGS: dict[str, LlamaConfig] = {
    # Tiny, for tests and laptops: every size divides TP=4 and the 4 layers split over PP=4.
    "debug": LlamaConfig(
        dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=128,
        rope_theta=10000.0, rope_scaling=None, max_seq_len=512,
    ),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    # Llama 2 13B (Llama 3 has no 13B): the seeds' "13B on 8 GPUs" row of docs/planning.md.
    "llama2-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, ffn_dim=13824,
                              rope_theta=10000.0, rope_scaling=None, max_seq_len=4096),
    "llama3-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
    # The debug model with a mixture of 8 experts (top-2) in every block.
    "debug-moe": LlamaConfig(
        dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=128, rope_theta=10000.0,
        rope_scaling=None, max_seq_len=512,
        moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=64, aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    ),
    # Mixtral 8x7B: 46,702,792,704 parameters, 12.9 B active per token.
    "mixtral-8x7b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_dim=14336, rope_theta=1e6,
        rope_scaling=None, max_seq_len=32768,
        moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=14336, aux_loss_coeff=1e-2),
    ),
    # DeepSeek-V3's MoE recipe at a small size (GQA attention, not MLA): a dense first block, 64
    # fine-grained experts (top-6) plus a shared one, sigmoid router scores scaled by 2.5,
    # auxiliary-loss-free balancing by expert bias and a small per-sequence auxiliary loss.
    "deepseek-v3-small": LlamaConfig(
        dim=1024, n_layers=12, n_heads=16, n_kv_heads=4, vocab_size=32768, ffn_dim=2816, rope_theta=10000.0,
        rope_scaling=None, max_seq_len=4096,
        moe=MoEConfig(num_experts=64, top_k=6, ffn_dim=352, first_dense_layers=1, shared_expert_ffn_dim=352,
                      score_func="sigmoid", route_scale=2.5, load_balancing="seq_aux_loss", aux_loss_coeff=1e-4,
                      expert_bias=True, bias_update_rate=1e-3),
    ),
}
