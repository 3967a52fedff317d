"""Megatron's MoE parallel folding with expert tensor parallelism 1: the experts are spread whole
over the expert-parallel ranks *and* the tensor-parallel ranks, instead of each expert's hidden
dim being split over the tensor-parallel ranks (ETP = TP).

Before the experts, every tensor-parallel rank holds the same tokens (the MoE layer's input is
whole over TP; routing runs on all of them, so the router's gradient and the balancing losses
stay equal on every TP rank). `FoldedDispatcher` lets each TP rank send only its 1/TP share of
the token rows (and their router weights) through an inner dispatcher over the folded group
(EP x TP ranks, experts split evenly over it), and gathers the combined rows back so the
layer's output is whole again. The gradients follow the same path backwards: the share's input
and router-weight gradients are all-gathered over TP, so everything before the layer sees the
whole, equal gradient on every TP rank.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtmega.kernels.errors import DtmegaError


class FoldedDispatcher:
    """Wraps a dispatcher whose group is the folded EP x TP ranks; `tp_mesh` is the 1-D mesh of
    the tensor-parallel ranks that hold the same tokens."""

    def __init__(self, inner, tp_mesh: DeviceMesh):
        self.inner, self.tp_mesh = inner, tp_mesh
        self.num_experts = inner.num_experts
        self.ranks, self.rank = tp_mesh.size(), tp_mesh.get_local_rank()

    def _share(self, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's rows of a tensor that is whole on every TP rank (backward: all-gather)."""
        if not tensor.requires_grad:
            return tensor.chunk(self.ranks)[self.rank]
        whole = DTensor.from_local(tensor, self.tp_mesh, [Replicate()], run_check=False)
        return whole.redistribute(self.tp_mesh, [Shard(0)]).to_local()

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor | None):
        """The inner dispatch of this TP rank's share of the token rows."""
        if x.shape[0] % self.ranks:
            raise DtmegaError(
                f"MoE parallel folding (expert tensor parallelism 1) splits each micro-batch's {x.shape[0]} tokens "
                f"over the {self.ranks} tensor-parallel ranks, which do not divide them. Fix: a micro-batch x sequence "
                f"length that is a multiple of {self.ranks} (sequence parallelism needs that too), or "
                "--expert-tensor-parallel-size equal to TP"
            )
        share_keep = keep.chunk(self.ranks)[self.rank] if keep is not None else None
        return self.inner.dispatch(self._share(x), ids.chunk(self.ranks)[self.rank], share_keep)

    def combine(self, rows: torch.Tensor, probs: torch.Tensor, state) -> torch.Tensor:
        """The inner combine for this rank's share, gathered over TP into the whole [T, D]."""
        share = self.inner.combine(rows, self._share(probs), state)
        gathered = DTensor.from_local(share, self.tp_mesh, [Shard(0)], run_check=False)
        # the gradient arriving from the layer's (whole, equal on every TP rank) output is this
        # rank's rows of it: no communication backwards
        return gathered.redistribute(self.tp_mesh, [Replicate()]).to_local(grad_placements=[Replicate()])
