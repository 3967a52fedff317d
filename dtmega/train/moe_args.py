"""The mixture-of-experts section of `dtmega train`'s arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class MoEArgs:
    """Mixture of experts: the experts, their router and its balancing, dispatch."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("moe_aux_loss_coeff", "moe_z_loss_coeff",
        "moe_router_bias_update_rate")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("moe_expert_capacity_factor", "moe_router_topk_scaling_factor")

    num_experts: int | None = _opt(None, "experts per MoE layer (unset: every block dense)")
    moe_router_topk: int = _opt(2, "experts each token is routed to")
    moe_ffn_hidden_size: int | None = _opt(None, "hidden size of one expert (default: --ffn-hidden-size)")
    moe_layer_freq: str = _opt("1", "MoE on every k-th block (an int), or a pattern '([0]*K+[1]*M)': K dense first")
    moe_shared_expert_intermediate_size: int | None = _opt(None, "hidden size of the shared experts (unset: none)")
    moe_router_score_function: str = _opt("softmax", "router scores", ("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = _opt(False, "softmax over all experts before top-k (default: over the k chosen)")
    moe_router_topk_scaling_factor: float | None = _opt(None, "multiply the routing weights by this")
    moe_router_load_balancing_type: str = _opt("aux_loss", "balancing: a loss over the micro-batch (aux_loss), per "
                                                           "sequence (seq_aux_loss), Megatron's Sinkhorn routing "
                                                           "(sinkhorn: balanced choices, no loss), or none; "
                                                           "global_aux_loss is not supported yet",
                                               ("aux_loss", "seq_aux_loss", "sinkhorn", "none", "global_aux_loss"))
    moe_aux_loss_coeff: float = _opt(0.0, "weight of the load-balancing loss")
    moe_z_loss_coeff: float | None = _opt(None, "weight of the router z-loss")
    moe_router_enable_expert_bias: bool = _opt(False, "auxiliary-loss-free balancing: a per-expert routing bias")
    moe_router_bias_update_rate: float = _opt(1e-3, "step of the expert-bias update")
    moe_expert_capacity_factor: float | None = _opt(None, "tokens per expert per sequence, x even share (unset: dropless)")
    moe_token_drop_policy: str = _opt("probs", "which tokens an over-capacity expert keeps", ("probs", "position"))
    moe_token_dispatcher_type: str = _opt("allgather", "how tokens reach their experts' ranks (flex: once per token "
                                                       "and rank, DeepEP's scheme)", ("alltoall", "allgather", "flex"))
    moe_grouped_gemm: bool = _opt(False, "run the local experts as one grouped GEMM (else a loop over experts)")
