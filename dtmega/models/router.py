"""The mixture-of-experts router: which experts each token goes to, with what weight, which
tokens an expert drops when it is over capacity, and the load-balancing losses.

Everything is a function of one token's (or one sequence's) values, except the load-balancing
statistics, which are summed over every rank holding tokens of the same micro-batch (`groups`),
so a sharded model routes, drops and balances exactly as the unsharded one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtmega.kernels.precision import accumulation_dtype
from dtmega.models.moe_config import MoEConfig


@dataclass
class Routing:
    """One micro-batch's routing decisions for T = B*S tokens."""

    probs: torch.Tensor  # [T, K] fp32 weights of the chosen experts (differentiable)
    ids: torch.Tensor  # [T, K] chosen experts
    keep: torch.Tensor | None  # [T, K] False where capacity dropped the assignment (None: dropless)
    scores: torch.Tensor  # [T, E] fp32 router probabilities over all experts (for the aux loss)
    logits: torch.Tensor  # [T, E] fp32 (for the z-loss)


@dataclass
class TokenGroups:
    """Process groups over which routing statistics are summed: `batch` holds every rank with
    other tokens of this micro-batch (data and context parallel); `sequence` the ranks sharing
    one sequence (context parallel). None: this rank alone."""

    batch: object | None = None
    sequence: object | None = None


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


class Router(nn.Module):
    """Top-k token-choice router: a linear gate, scores, top-k, optional expert bias and
    capacity dropping."""

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(dim, config.num_experts, bias=False)
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts), persistent=True)
            self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts), persistent=False)

    def reset_buffers(self, device: torch.device) -> None:
        """Zeroes the expert bias and the load counter (after materializing on `device`)."""
        if self.config.expert_bias:
            self.expert_bias = torch.zeros(self.config.num_experts, device=device)
            self.tokens_per_expert = torch.zeros(self.config.num_experts, device=device)

    def forward(self, x: torch.Tensor, batch: int, seq: int, groups: TokenGroups | None = None) -> Routing:
        """Routes the T = batch*seq tokens of `x` [T, D] (`groups`: the ranks holding the rest of
        the micro-batch, which Sinkhorn routing balances over)."""
        c = self.config
        weight = self.gate.weight
        dtype = accumulation_dtype(x.dtype)  # fp32 routing for bf16 models, float64 for float64 ones
        logits = F.linear(x.to(dtype), weight.to(dtype))
        if c.load_balancing == "sinkhorn":
            return self._sinkhorn_routing(logits, batch, seq, groups)
        raw = torch.sigmoid(logits) if c.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = raw.detach()
        if c.expert_bias:
            choice = choice + self.expert_bias
        if c.num_groups is not None:
            choice = limit_to_best_groups(choice, c.num_groups, c.group_topk)
        ids = torch.topk(choice, c.top_k, dim=-1).indices
        if c.score_func == "sigmoid":
            probs = raw.gather(1, ids)
            if c.top_k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
            scores = raw / (raw.sum(dim=-1, keepdim=True) + 1e-20)
        elif c.pre_softmax:
            probs, scores = raw.gather(1, ids), raw
        else:
            probs, scores = torch.softmax(logits.gather(1, ids), dim=-1), raw
        probs = probs * c.route_scale
        keep = None if c.capacity_factor is None else self._capacity_keep(probs.detach(), ids, batch, seq)
        return Routing(probs, ids, keep, scores, logits)

    def _sinkhorn_routing(self, logits: torch.Tensor, batch: int, seq: int, groups: TokenGroups | None) -> Routing:
        """Megatron's Sinkhorn router: in training the experts are the top-k of the micro-batch's
        Sinkhorn-balanced scores (no gradient), at evaluation the top-k of the weights; the
        weights are sigmoid(logits) for top-1, softmax(logits) otherwise, not renormalized."""
        c = self.config
        weights = torch.sigmoid(logits) if c.top_k == 1 else torch.softmax(logits, dim=-1)
        if self.training:
            with torch.no_grad():
                balanced = sinkhorn(logits.float(), groups.batch if groups is not None else None)
            ids = torch.topk(balanced, c.top_k, dim=-1).indices
        else:
            ids = torch.topk(weights.detach(), c.top_k, dim=-1).indices
        probs = weights.gather(1, ids) * c.route_scale
        keep = None if c.capacity_factor is None else self._capacity_keep(probs.detach(), ids, batch, seq)
        return Routing(probs, ids, keep, torch.softmax(logits, dim=-1), logits)

    def _capacity_keep(self, probs: torch.Tensor, ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Which assignments fit: per sequence, each expert keeps `capacity` of its tokens."""
        c = self.config
        capacity = c.capacity(seq)
        chosen = torch.zeros(batch * seq, c.num_experts, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)
        chosen = chosen.view(batch, seq, c.num_experts)
        if c.token_drop_policy == "position":
            fits = chosen & (chosen.cumsum(dim=1) <= capacity)
        else:
            weight = torch.zeros(batch * seq, c.num_experts, device=ids.device).scatter_(1, ids, probs)
            weight = weight.view(batch, seq, c.num_experts).masked_fill(~chosen, -1.0)
            best = weight.topk(min(capacity, seq), dim=1).indices
            fits = torch.zeros_like(chosen).scatter_(1, best, True) & chosen
        return fits.view(batch * seq, c.num_experts).gather(1, ids)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free step: raise the bias of under-loaded experts and
        lower it for over-loaded ones by `bias_update_rate` (from the whole step's counts)."""
        offset = tokens_per_expert.mean() - tokens_per_expert
        self.expert_bias += torch.sign(offset) * self.config.bias_update_rate


def sinkhorn(logits: torch.Tensor, group=None, tol: float = 1e-4, max_iterations: int = 10_000) -> torch.Tensor:
    """Megatron's Sinkhorn balancing of exp(logits) [T, E] over every token of the micro-batch:
    this rank's T rows and, through `group`, the other ranks' (each column sum is all-reduced
    and the row scale is over the global token count, so a sharded micro-batch balances exactly
    as the whole one). Iterates until the column scales move by less than `tol` on average, as
    Megatron does; every rank sees the same column scales, so every rank stops at the same step."""
    cost = torch.exp(logits)
    tokens = torch.tensor(float(cost.shape[0]), dtype=cost.dtype, device=cost.device)
    _all_reduce(tokens, group)
    experts = cost.shape[1]
    eps = 1e-8
    d1 = torch.ones(experts, dtype=cost.dtype, device=cost.device)
    for _ in range(max_iterations):
        d0 = (1 / tokens) / (cost @ d1 + eps)
        columns = _all_reduce((d0.unsqueeze(1) * cost).sum(0), group)
        new_d1 = (1 / experts) / (columns + eps)
        error = torch.mean(torch.abs(d1 - new_d1)).item()
        d1 = new_d1
        if error <= tol:
            break
    return d1 * cost * d0.unsqueeze(1)


def limit_to_best_groups(choice: torch.Tensor, num_groups: int, group_topk: int) -> torch.Tensor:
    """`choice` [T, E] with every expert outside each token's best `group_topk` groups set to
    -inf; a group's score is the sum of its two best choice scores (one for one-expert groups)."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best = group_scores.topk(group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)


def balancing_loss(routing: Routing, config: MoEConfig, batch: int, seq: int, groups: TokenGroups) -> torch.Tensor | None:
    """This rank's share of aux_loss_coeff * (load-balancing loss) + z_loss_coeff * (z-loss):
    shares of all ranks in `groups.batch` add up to the unsharded model's loss of the micro-batch.

    Load balancing (GShard/Switch): E * sum_e f_e * P_e with f_e the fraction of routed
    assignments that chose e and P_e the mean router probability of e, over the micro-batch
    (`aux_loss`) or each sequence, averaged over sequences (`seq_aux_loss`). Only P_e carries a
    gradient, so a rank's share is its tokens' part of P_e times the global f_e.
    """
    c = config
    balance = c.load_balancing not in ("none", "sinkhorn") and c.aux_loss_coeff > 0
    if not balance and c.z_loss_coeff == 0:
        return None
    experts, top_k, tokens = c.num_experts, c.top_k, batch * seq
    chosen = torch.zeros(tokens, experts, device=routing.ids.device).scatter_(1, routing.ids, 1.0)
    with torch.no_grad():
        per_batch = torch.cat([chosen.sum(0), torch.tensor([tokens, batch], dtype=torch.float32,
                                                           device=chosen.device)])
        _all_reduce(per_batch, groups.batch)
    global_tokens = per_batch[experts]
    loss = torch.zeros((), device=chosen.device)
    if balance and c.load_balancing == "aux_loss":
        fraction = per_batch[:experts] / (global_tokens * top_k)
        loss = loss + c.aux_loss_coeff * experts * (fraction * routing.scores.sum(0)).sum() / global_tokens
    elif balance:
        sharers = _group_size(groups.sequence)  # ranks holding parts of each sequence
        with torch.no_grad():
            per_sequence = _all_reduce(chosen.view(batch, seq, experts).sum(1), groups.sequence)
        sequences = per_batch[experts + 1] / sharers
        full_seq = seq * sharers
        fraction = per_sequence / (full_seq * top_k)
        probability = routing.scores.view(batch, seq, experts).sum(1) / full_seq
        loss = loss + c.aux_loss_coeff * experts * (fraction * probability).sum() / sequences
    if c.z_loss_coeff > 0:
        z = torch.logsumexp(routing.logits, dim=-1).square().sum() / global_tokens
        loss = loss + c.z_loss_coeff * z
    return loss
