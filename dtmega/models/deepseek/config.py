"""Configuration of dtmega's DeepSeek-V3 family and its named sizes.

Multi-latent attention (MLA, DeepSeek-V2's): queries through an optional low-rank latent
(`q_lora_rank`), keys and values through one shared latent of `kv_lora_rank` channels plus a
single rotary key of `qk_rope_head_dim` channels; each head's query/key is `qk_nope_head_dim`
channels without position plus the rotary ones, and its value `v_head_dim` wide. Generation
caches only the latent and the rotary key. RoPE may be stretched by YaRN (`YarnScaling`), with
DeepSeek's attention-scale correction (mscale).

The feed-forwards are dtmega's MoE (models/moe.py) with DeepSeek-V3's router: sigmoid scores,
an expert bias for auxiliary-loss-free balancing, group-limited routing (`num_groups` groups
of experts, a token's experts drawn from its best `group_topk` groups), normalized top-k
weights scaled by `route_scale`, shared experts, the first `first_dense_layers` blocks dense.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dtmega.kernels.errors import DtmegaError
from dtmega.models.config_checks import number_problems
from dtmega.models.moe_config import MoEConfig


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's RoPE stretching (Megatron's --rope-type yarn; HF rope_parameters of type "yarn")."""

    factor: float = 40.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @staticmethod
    def _mscale(factor: float, mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def rope_factor(self) -> float:
        """What the rotated channels of q and k are multiplied by (1.0 for DeepSeek-V3's mscales)."""
        return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_factor(self) -> float:
        """What the softmax scale 1/sqrt(qk_head_dim) is multiplied by (DeepSeek's mscale²)."""
        return self._mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True)
class DeepSeekConfig:
    """Shape of a DeepSeek-V3-style decoder (Megatron's flag names in the comments)."""

    dim: int = 7168                      # --hidden-size
    n_layers: int = 61                   # --num-layers
    n_heads: int = 128                   # --num-attention-heads
    vocab_size: int = 129280
    ffn_dim: int = 18432                 # --ffn-hidden-size (the dense blocks)
    q_lora_rank: int | None = 1536       # --q-lora-rank (None: a full-rank query projection)
    kv_lora_rank: int = 512              # --kv-lora-rank
    qk_nope_head_dim: int = 128          # --qk-head-dim
    qk_rope_head_dim: int = 64           # --qk-pos-emb-head-dim
    v_head_dim: int = 128                # --v-head-dim
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    yarn: YarnScaling | None = dataclasses.field(default_factory=YarnScaling)
    max_seq_len: int = 163840
    tie_embeddings: bool = False
    init_std: float = 0.006
    moe: MoEConfig | None = None
    mtp_num_layers: int = 0              # --mtp-num-layers
    mtp_loss_scaling_factor: float = 0.1  # --mtp-loss-scaling-factor

    def __post_init__(self) -> None:
        problems = []
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            problems.append(f"q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates channel pairs)")
        if self.mtp_num_layers < 0 or self.mtp_loss_scaling_factor < 0:
            problems.append("mtp_num_layers and mtp_loss_scaling_factor must be >= 0")
        problems += number_problems(self, positive=("rope_theta", "norm_eps"), non_negative=("init_std",))
        if self.yarn is not None:
            problems += [f"yarn.{line}" for line in number_problems(
                self.yarn, positive=("original_max_seq_len", "beta_fast", "beta_slow"), at_least_one=("factor",),
                non_negative=("mscale", "mscale_all_dim"))]
        if problems:
            raise DtmegaError("invalid DeepSeekConfig: " + "; ".join(problems))

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: the position-free part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale² when RoPE is stretched."""
        return self.qk_head_dim ** -0.5 * (self.yarn.softmax_factor if self.yarn else 1.0)

    def replace(self, **changes) -> "DeepSeekConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def attention_params(self) -> int:
        """Parameters of one MLA attention (projections and latent norms)."""
        h, d = self.n_heads, self.dim
        if self.q_lora_rank is None:
            query = d * h * self.qk_head_dim
        else:
            query = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return query + kv + h * self.v_head_dim * d

    def block_params(self, index: int) -> int:
        """Parameters of block `index` (attention, feed-forward, two norms)."""
        ffn = self.moe.params_per_layer(self.dim) if self._moe_at(index) else 3 * self.dim * self.ffn_dim
        return self.attention_params() + ffn + 2 * self.dim

    def mtp_params(self) -> int:
        """Parameters of the multi-token-prediction modules (embedding and head shared with the
        model): three norms, the 2D -> D projection and one block (MoE when the last block is) each."""
        block = self.attention_params() + 3 * self.dim
        block += self.moe.params_per_layer(self.dim) if self._moe_at(self.n_layers - 1) else 3 * self.dim * self.ffn_dim
        return self.mtp_num_layers * (2 * self.dim + 2 * self.dim * self.dim + block)

    def _moe_at(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    def num_params(self, with_mtp: bool = False) -> int:
        """Exact parameter count from the shapes alone (DeepSeek publishes V3's as 671 B
        without its MTP module)."""
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        total = embeddings + sum(self.block_params(i) for i in range(self.n_layers)) + self.dim
        return total + (self.mtp_params() if with_mtp else 0)

    def num_active_params(self, with_mtp: bool = False) -> int:
        """Parameters one token passes through: top_k of the routed experts."""
        if self.moe is None:
            return self.num_params(with_mtp)
        idle = 3 * self.dim * self.moe.ffn_dim * (self.moe.num_experts - self.moe.top_k)
        blocks = sum(self._moe_at(i) for i in range(self.n_layers))
        blocks += self.mtp_num_layers if (with_mtp and self._moe_at(self.n_layers - 1)) else 0
        return self.num_params(with_mtp) - idle * blocks

    def num_activated_params(self) -> int:
        """Parameters a token's computation uses, as DeepSeek reports "activated" parameters:
        the active ones without the input embedding (a lookup, no arithmetic)."""
        return self.num_active_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim)

    def kv_cache_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """What generation caches per token and layer: the latent and the rotary key."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_value

    def mha_cache_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """The same attention's cache if keys and values were cached per head (no latent)."""
        return self.n_heads * (self.qk_head_dim + self.v_head_dim) * bytes_per_value

    @classmethod
    def from_name(cls, name: str, **overrides) -> "DeepSeekConfig":
        """A named size (`deepseek-v3`, `deepseek-v2-lite`, `deepseek-debug`), optionally overridden."""
        if name not in NAMED_CONFIGS:
            raise KeyError(f"unknown DeepSeek config {name!r}; known: {', '.join(sorted(NAMED_CONFIGS))}")
        return dataclasses.replace(NAMED_CONFIGS[name], **overrides)


def _v3_moe(**overrides) -> MoEConfig:
    """DeepSeek-V3's router and experts: 256 routed (top-8 from 4 of 8 groups) + 1 shared."""
    settings = dict(num_experts=256, top_k=8, ffn_dim=2048, first_dense_layers=3, shared_expert_ffn_dim=2048,
                    score_func="sigmoid", route_scale=2.5, num_groups=8, group_topk=4, load_balancing="seq_aux_loss",
                    aux_loss_coeff=1e-4, expert_bias=True, bias_update_rate=1e-3)
    settings.update(overrides)
    return MoEConfig(**settings)


NAMED_CONFIGS: dict[str, DeepSeekConfig] = {
    # 671,026,522,112 parameters (37.5 B active) without the MTP module, as DeepSeek counts them.
    "deepseek-v3": DeepSeekConfig(moe=_v3_moe(), mtp_num_layers=1),
    # DeepSeek-V2-Lite: 15.7 B (2.4 B active): full-rank queries, 64 experts (top-6, softmax, no
    # groups), 2 shared, one dense block.
    "deepseek-v2-lite": DeepSeekConfig(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_dim=10944, q_lora_rank=None, kv_lora_rank=512,
        yarn=None, max_seq_len=32768,
        moe=MoEConfig(num_experts=64, top_k=6, ffn_dim=1408, first_dense_layers=1, shared_expert_ffn_dim=2816,
                      score_func="softmax", pre_softmax=True, aux_loss_coeff=1e-3),
    ),
    # Kimi-K2 (moonshotai/Kimi-K2-Base and -Instruct, July 2025; DeepseekV3ForCausalLM in its
    # config.json): DeepSeek-V3's blocks with 64 heads, 384 routed experts (top-8, one group) + 1
    # shared, one dense block, weights scaled by 2.827, RoPE base 50,000 stretched 32x by YaRN
    # (beta_fast = beta_slow = 1), a 163,840-token vocabulary, no MTP layer: 1,026,408,209,408
    # parameters (32.9 B active per token), the published "1T total, 32B activated".
    "kimi-k2": DeepSeekConfig(
        n_heads=64, vocab_size=163840, rope_theta=50000.0, max_seq_len=131072,
        yarn=YarnScaling(factor=32.0, original_max_seq_len=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                         mscale_all_dim=1.0),
        moe=_v3_moe(num_experts=384, first_dense_layers=1, route_scale=2.827, num_groups=None, group_topk=None),
    ),
    # Trains on a laptop: every size divides TP=4 and EP=4 (2 experts per group per EP rank).
    "deepseek-debug": DeepSeekConfig(
        dim=64, n_layers=4, n_heads=8, vocab_size=256, ffn_dim=128, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, yarn=None, max_seq_len=512, init_std=0.02,
        moe=_v3_moe(num_experts=8, top_k=2, ffn_dim=32, first_dense_layers=1, shared_expert_ffn_dim=32,
                    num_groups=4, group_topk=2),
        mtp_num_layers=1,
    ),
}
