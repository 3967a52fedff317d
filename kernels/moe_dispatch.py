"""Token dispatch for mixture-of-experts layers: send each token's routed copies to the ranks
that hold their experts, and bring the expert outputs back, weighted by the router.

A dispatcher turns a rank's tokens x [T, D] with their experts `ids` [T, K] (and a `keep` mask
for capacity dropping) into rows sorted by *local* expert, ready for a grouped GEMM, and
combines the expert outputs back into [T, D] (output = sum over kept k of probs * expert(x)).

- `LocalDispatcher`: every expert on this rank (no expert parallelism).
- `AllToAllDispatcher`: experts split over an expert-parallel group; token rows travel by
  `all_to_all_single` with uneven splits (autograd-aware), router weights never leave home.
- `AllGatherDispatcher`: every rank gathers all tokens of the group, computes its experts'
  share, and the weighted outputs are reduce-scattered home.
- `FlexDispatcher` (Megatron's `--moe-token-dispatcher-type flex`, DeepEP's scheme): each token
  travels once to each rank holding any of its experts (not once per expert), with the local
  expert ids; the router weights follow in the combine, the rank sums its experts' weighted
  outputs per token and sends one row back. Group-limited routing (a token's experts on at most
  `group_topk` ranks) then bounds the bytes.

All are plain PyTorch and torch.distributed (gloo and nccl alike). `CommStats` counts the
bytes a rank sends for token movement, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from dtmega.kernels.context_shards import CommStats
from dtmega.kernels.precision import accumulation_dtype

DISPATCHERS = ("alltoall", "allgather", "flex")


def sort_by_expert(ids: torch.Tensor, keep: torch.Tensor | None, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices into the flattened [T*K] assignments that are kept, ordered by expert and then
    by position; assignments per expert [E])."""
    flat = ids.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped ones sort last, uncounted
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    return order[: int(counts.sum())], counts


def weighted_sum(rows: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, top_k: int, tokens: int) -> torch.Tensor:
    """[tokens, D]: each expert output row times its router weight, summed into its token."""
    weights = probs.reshape(-1)[order].unsqueeze(1)
    weighted = (rows.to(accumulation_dtype(rows.dtype)) * weights).to(rows.dtype)
    out = rows.new_zeros(tokens, rows.shape[1])
    return out.index_add(0, order // top_k, weighted)


def _count_backward(tensor: torch.Tensor, stats: CommStats | None, remote_rows: int) -> None:
    """The backward of a token exchange sends back as many rows as it received from others."""
    if stats is not None and tensor.requires_grad and remote_rows:
        def count(grad):
            stats.bytes_sent += remote_rows * grad.shape[1] * grad.element_size()
        tensor.register_hook(count)


@dataclass
class Dispatched:
    """What `combine` needs to undo a dispatch."""

    order: torch.Tensor  # kept assignments (into the flattened [T*K] or gathered [G*T*K]), by expert
    tokens: int  # T
    top_k: int
    regroup: torch.Tensor | None = None  # received rows -> rows sorted by local expert
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None


class LocalDispatcher:
    """Every expert lives on this rank."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor | None):
        """(rows sorted by expert, rows per expert [E], state for combine)."""
        order, counts = sort_by_expert(ids, keep, self.num_experts)
        top_k = ids.shape[1]
        return x[order // top_k], counts, Dispatched(order, x.shape[0], top_k)

    def combine(self, rows: torch.Tensor, probs: torch.Tensor, state: Dispatched) -> torch.Tensor:
        """[T, D] outputs, router-weighted."""
        return weighted_sum(rows, state.order, probs, state.top_k, state.tokens)


class _GroupDispatcher(LocalDispatcher):
    """Experts split evenly over `group` (rank r holds experts r*E/ep ... (r+1)*E/ep - 1);
    `stats` counts the bytes each rank sends."""

    def __init__(self, num_experts: int, group, stats: CommStats | None = None):
        super().__init__(num_experts)
        self.group, self.stats = group, stats
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local_experts = num_experts // self.world


class AllToAllDispatcher(_GroupDispatcher):
    """Each token row travels to the rank holding its expert and back (uneven all-to-all)."""

    def dispatch(self, x, ids, keep):
        order, counts = sort_by_expert(ids, keep, self.num_experts)
        top_k = ids.shape[1]
        rows = x[order // top_k]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # rows per (source rank, local expert)
        per_source = received.view(self.world, self.local_experts)
        input_splits = counts.view(self.world, self.local_experts).sum(1).tolist()
        output_splits = per_source.sum(1).tolist()
        moved = funcol.all_to_all_single(rows.contiguous(), output_splits, input_splits, self.group)
        self._count(rows, input_splits, output_splits, moved)
        expert_of_row = torch.arange(self.local_experts, device=x.device).repeat(self.world)
        regroup = torch.argsort(torch.repeat_interleave(expert_of_row, per_source.reshape(-1)), stable=True)
        state = Dispatched(order, x.shape[0], top_k, regroup, input_splits, output_splits)
        return moved[regroup], per_source.sum(0), state

    def combine(self, rows, probs, state):
        back = torch.empty_like(rows).index_copy(0, state.regroup, rows)  # undo the regrouping
        home = funcol.all_to_all_single(back, state.input_splits, state.output_splits, self.group)
        self._count(back, state.output_splits, state.input_splits, home)
        return weighted_sum(home, state.order, probs, state.top_k, state.tokens)

    def _count(self, sent: torch.Tensor, splits: list[int], received_splits: list[int], received: torch.Tensor):
        if self.stats is None:
            return
        self.stats.bytes_sent += (sum(splits) - splits[self.rank]) * sent.shape[1] * sent.element_size()
        _count_backward(received, self.stats, sum(received_splits) - received_splits[self.rank])


@dataclass
class PairsDispatched:
    """What `FlexDispatcher.combine` needs: the (token, rank) pairs sent, which of each token's
    assignments went with each pair, and the received rows' expert order."""

    order: torch.Tensor  # kept (received row, k) assignments, by local expert
    received: int  # rows received
    top_k: int
    tokens: torch.Tensor  # [P] home token of each pair sent, by destination rank
    assigned: torch.Tensor  # [P, K] which of the token's assignments the pair carries
    home_tokens: int
    input_splits: list[int]
    output_splits: list[int]


class FlexDispatcher(_GroupDispatcher):
    """One row per (token, destination rank) each way; see the module docstring."""

    def dispatch(self, x, ids, keep):
        tokens, top_k = ids.shape
        rank_of = ids // self.local_experts
        valid = torch.ones_like(ids, dtype=torch.bool) if keep is None else keep
        pairs = torch.zeros(tokens, self.world, dtype=torch.bool, device=ids.device)
        token_of = torch.arange(tokens, device=ids.device)[:, None].expand(tokens, top_k)
        pairs[token_of[valid], rank_of[valid]] = True
        send_rank, send_token = pairs.t().nonzero(as_tuple=True)  # by destination rank, then token
        assigned = (rank_of[send_token] == send_rank[:, None]) & valid[send_token]
        local_ids = torch.where(assigned, ids[send_token] - send_rank[:, None] * self.local_experts, -1)
        input_splits = pairs.sum(0).tolist()
        received = torch.empty(self.world, dtype=torch.long, device=ids.device)
        dist.all_to_all_single(received, torch.tensor(input_splits, device=ids.device), group=self.group)
        output_splits = received.tolist()
        moved = funcol.all_to_all_single(x[send_token].contiguous(), output_splits, input_splits, self.group)
        self._count(x, input_splits, output_splits, moved)
        moved_ids = local_ids.new_empty((sum(output_splits), top_k))
        dist.all_to_all_single(moved_ids, local_ids.contiguous(), output_splits, input_splits, group=self.group)
        if self.stats is not None:
            self.stats.add(local_ids[:0].new_empty((sum(input_splits) - input_splits[self.rank], top_k)))
        order, counts = sort_by_expert(moved_ids.clamp(min=0), moved_ids >= 0, self.local_experts)
        state = PairsDispatched(order, moved.shape[0], top_k, send_token, assigned, tokens, input_splits, output_splits)
        return moved[order // top_k], counts, state

    def combine(self, rows, probs, state):
        weights = torch.where(state.assigned, probs[state.tokens], 0.0)
        moved_weights = funcol.all_to_all_single(weights.contiguous(), state.output_splits, state.input_splits,
                                                 self.group)
        self._count(weights, state.input_splits, state.output_splits, moved_weights)
        per_pair = weighted_sum(rows, state.order, moved_weights, state.top_k, state.received)
        home = funcol.all_to_all_single(per_pair, state.input_splits, state.output_splits, self.group)
        self._count(per_pair, state.output_splits, state.input_splits, home)
        return per_pair.new_zeros(state.home_tokens, per_pair.shape[1]).index_add(0, state.tokens, home)

    def _count(self, sent: torch.Tensor, splits: list[int], received_splits: list[int], received: torch.Tensor):
        if self.stats is None:
            return
        self.stats.bytes_sent += (sum(splits) - splits[self.rank]) * sent.shape[1] * sent.element_size()
        _count_backward(received, self.stats, sum(received_splits) - received_splits[self.rank])


class AllGatherDispatcher(_GroupDispatcher):
    """Every rank of `group` sees all of the group's tokens and computes its own experts' share."""

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad:
            gathered = funcol.all_gather_single(tensor.contiguous(), 0, self.group)
            _count_backward(gathered, self.stats, tensor.shape[0] * (self.world - 1))
        else:
            gathered = torch.empty((self.world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                                   device=tensor.device)
            dist.all_gather_into_tensor(gathered, tensor.contiguous(), group=self.group)
        if self.stats is not None:
            self.stats.bytes_sent += tensor.numel() * tensor.element_size() * (self.world - 1)
        return gathered

    def dispatch(self, x, ids, keep):
        top_k = ids.shape[1]
        all_ids = self._gather(ids)
        first = self.rank * self.local_experts
        mine = (all_ids >= first) & (all_ids < first + self.local_experts)
        if keep is not None:
            mine &= self._gather(keep)
        order, counts = sort_by_expert((all_ids - first).clamp(0, self.local_experts - 1), mine, self.local_experts)
        all_x = self._gather(x.reshape(x.shape[0], -1))
        return all_x[order // top_k], counts, Dispatched(order, all_x.shape[0], top_k)

    def combine(self, rows, probs, state):
        all_probs = self._gather(probs)
        partial = weighted_sum(rows, state.order, all_probs, state.top_k, state.tokens)
        home = funcol.reduce_scatter_single(partial, "sum", 0, self.group)
        if self.stats is not None:
            self.stats.bytes_sent += partial.numel() * partial.element_size() * (self.world - 1) // self.world
            _count_backward(home, self.stats, home.shape[0] * (self.world - 1))
        return home
