"""Configuration of the mixture-of-experts feed-forward of the Llama family."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtmega.kernels.errors import DtmegaError

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
EXPERT_ACTIVATIONS = ("swiglu", "gelu", "squared_relu")
DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class MoEConfig:
    """Which layers are MoE and how their router and experts behave (Megatron's --moe-* flags).

    Router: `score_func` softmax or sigmoid; with softmax, `pre_softmax` takes the softmax over
    all experts before top-k (else over the k chosen logits, Mixtral's form); sigmoid scores of
    the k chosen are normalized to sum to one; the weights are multiplied by `route_scale`.
    Load balancing: GShard/Switch auxiliary loss over the global micro-batch (`aux_loss`) or per
    sequence (`seq_aux_loss`), times `aux_loss_coeff`; or Megatron's Sinkhorn routing (`sinkhorn`:
    in training the experts are chosen from the Sinkhorn-balanced scores of the micro-batch's
    tokens, no auxiliary loss; weights are the sigmoid of the logits for top-1, else their softmax);
    `z_loss_coeff` for the router z-loss; and
    `expert_bias` for DeepSeek-V3's auxiliary-loss-free balancing (a per-expert bias added to
    the scores only to choose experts, moved by `bias_update_rate` towards balance each step).
    Group-limited routing (DeepSeek-V3, `num_groups` and `group_topk`): the experts form
    `num_groups` equal runs; each token ranks the groups by the sum of its two best scores in
    each (DeepSeek's reference code) and takes its top_k experts from its best `group_topk` groups.
    Experts are SwiGLU (`activation="swiglu"`: w1 gate, w3 up, w2 down), or GeLU / squared-ReLU
    MLPs without biases (w1 up, w2 down: Megatron's GPT-block experts; `gelu_approximate` "none"
    is F.gelu, what Megatron's experts compute without biases).
    Dropless unless `capacity_factor` is set: then each expert takes at most
    ceil(capacity_factor * seq_len * top_k / num_experts) tokens of each sequence, keeping the
    highest router weights (`token_drop_policy="probs"`) or the earliest tokens ("position").
    """

    num_experts: int = 8
    top_k: int = 2
    ffn_dim: int = 14336
    layer_freq: int = 1
    first_dense_layers: int = 0
    shared_expert_ffn_dim: int = 0
    score_func: str = "softmax"
    pre_softmax: bool = False
    route_scale: float = 1.0
    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    grouped_gemm: bool = True
    num_groups: int | None = None  # --moe-router-num-groups: experts in equal consecutive groups
    group_topk: int | None = None  # --moe-router-group-topk: a token's experts come from its best groups
    activation: str = "swiglu"  # the experts' MLP: swiglu (w1, w3, w2), gelu or squared_relu (w1, w2)
    gelu_approximate: str = "none"  # GeLU experts: "none" (erf, F.gelu) or "tanh"

    def __post_init__(self) -> None:
        problems = []
        if self.num_experts < 1 or self.ffn_dim < 1:
            problems.append(f"num_experts ({self.num_experts}) and ffn_dim ({self.ffn_dim}) must be positive")
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(
                f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts} (a token cannot use "
                "more experts than exist)"
            )
        if self.layer_freq < 1 or self.first_dense_layers < 0 or self.shared_expert_ffn_dim < 0:
            problems.append("layer_freq must be >= 1, first_dense_layers and shared_expert_ffn_dim >= 0")
        for name, value, allowed in (("score_func", self.score_func, SCORE_FUNCTIONS),
                                     ("load_balancing", self.load_balancing, LOAD_BALANCING),
                                     ("token_drop_policy", self.token_drop_policy, DROP_POLICIES),
                                     ("activation", self.activation, EXPERT_ACTIVATIONS),
                                     ("gelu_approximate", self.gelu_approximate, ("none", "tanh"))):
            if value not in allowed:
                problems.append(f"{name}={value!r} is not one of {allowed}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            problems.append(
                f"capacity_factor={self.capacity_factor} must be > 0 (or None for dropless routing); "
                "1.0 gives each expert its even share of the tokens"
            )
        if self.load_balancing == "sinkhorn" and (self.expert_bias or self.num_groups is not None
                                                  or self.score_func != "softmax" or self.aux_loss_coeff > 0):
            problems.append("sinkhorn routing balances the experts itself: no auxiliary loss (--moe-aux-loss-coeff 0), "
                            "expert bias, group-limited routing or sigmoid score function with it (Megatron's "
                            "Sinkhorn router has none)")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0 or self.bias_update_rate < 0:
            problems.append("aux_loss_coeff, z_loss_coeff and bias_update_rate must be >= 0")
        problems += self._group_problems()
        if problems:
            raise DtmegaError("invalid MoEConfig: " + "; ".join(problems))

    def _group_problems(self) -> list[str]:
        if self.num_groups is None and self.group_topk is None:
            return []
        if self.num_groups is None or self.group_topk is None:
            return ["group-limited routing needs both num_groups (--moe-router-num-groups) and group_topk "
                    "(--moe-router-group-topk)"]
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            return [f"num_experts={self.num_experts} is not divisible by num_groups={self.num_groups} (groups are "
                    "equal runs of consecutive experts)"]
        if not 1 <= self.group_topk <= self.num_groups:
            return [f"group_topk={self.group_topk} must be between 1 and num_groups={self.num_groups} (a token "
                    "cannot pick more groups than exist)"]
        if self.group_topk * (self.num_experts // self.num_groups) < self.top_k:
            return [f"group_topk={self.group_topk} groups of {self.num_experts // self.num_groups} experts hold fewer "
                    f"than top_k={self.top_k} experts"]
        return []

    @property
    def experts_per_group(self) -> int:
        """Experts in one routing group (all of them without group-limited routing)."""
        return self.num_experts // (self.num_groups or 1)

    def is_moe_layer(self, index: int) -> bool:
        """Megatron's --moe-layer-freq after the first dense layers: layer i is MoE when
        (i - first_dense_layers) is a multiple of layer_freq."""
        return index >= self.first_dense_layers and (index - self.first_dense_layers) % self.layer_freq == 0

    def capacity(self, seq_len: int) -> int:
        """Tokens of one sequence each expert takes when dropping (capacity_factor set)."""
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.num_experts)

    @property
    def expert_matrices(self) -> int:
        """Weight matrices of one expert: 3 for SwiGLU (gate, up, down), 2 otherwise (up, down)."""
        return 3 if self.activation == "swiglu" else 2

    def params_per_layer(self, dim: int) -> int:
        """Parameters of one MoE feed-forward: router, experts, shared experts."""
        return (dim * self.num_experts + self.expert_matrices * dim * self.ffn_dim * self.num_experts
                + 3 * dim * self.shared_expert_ffn_dim)
