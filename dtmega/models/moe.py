"""The mixture-of-experts feed-forward: router, experts as one grouped GEMM, optional shared
experts, and a token dispatcher that expert parallelism swaps for a distributed one.

The module computes its load-balancing losses itself and attaches their gradient to its output
(scaled by `loss_scale`, which `ParallelModel` sets to match how it scales the language-model
loss), so the model's forward still returns logits and a plain `loss.backward()` trains the
router; the values are kept in `stats` for logging and for the reported loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from dtmega.kernels.grouped_gemm import grouped_mm
from dtmega.kernels.moe_dispatch import LocalDispatcher
from dtmega.models.feed_forward import FeedForward
from dtmega.models.moe_config import MoEConfig
from dtmega.models.router import Router, Routing, TokenGroups, balancing_loss


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class GroupedExperts(nn.Module):
    """E experts stored as [E, ...] weights (nn.Linear layout per expert): SwiGLU (w1 gate, w3 up,
    w2 down), or a GeLU / squared-ReLU MLP (w1 up, w2 down; no w3), all without biases."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, grouped: bool = True,
                 activation: str = "swiglu", gelu_approximate: str = "none"):
        super().__init__()
        self.grouped = grouped
        self.activation, self.gelu_approximate = activation, gelu_approximate
        self.tp_mesh = None  # set when each rank holds a slice of every expert's hidden dim
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if activation == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        else:
            self.register_parameter("w3", None)

    def _hidden(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        up = grouped_mm(x, _local(self.w1), counts, self.grouped)
        if self.activation == "swiglu":
            return F.silu(up) * grouped_mm(x, _local(self.w3), counts, self.grouped)
        if self.activation == "gelu":
            return F.gelu(up, approximate=self.gelu_approximate)
        return F.relu(up).square()  # squared ReLU

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, D] rows sorted by (local) expert, counts [e] rows per expert -> [N, D]. Under
        expert or expert-tensor parallelism the weights are this rank's shards."""
        w2 = _local(self.w2)
        x = x.to(w2.dtype)
        if self.tp_mesh is not None:  # each hidden-dim shard gives a partial input gradient: sum them
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        out = grouped_mm(self._hidden(x, counts), w2, counts, self.grouped)
        if self.tp_mesh is not None:  # partial sums over the hidden-dim shards
            partial = DTensor.from_local(out, self.tp_mesh, [Partial()], run_check=False)
            out = partial.redistribute(placements=[Replicate()]).to_local().clone()  # not a view: FSDP hooks it
        return out


class _AttachLoss(torch.autograd.Function):
    """Identity on `out` whose backward also gives `loss` the gradient `scale`."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale = scale
        ctx.loss_like = (loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.loss_like
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Token-choice top-k mixture of experts (SwiGLU, GeLU or squared-ReLU; + shared experts) for
    x [B, S, D]."""

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = Router(dim, config)
        self.experts = GroupedExperts(config.num_experts, dim, config.ffn_dim, config.grouped_gemm,
                                      config.activation, config.gelu_approximate)
        self.shared_experts = FeedForward(dim, config.shared_expert_ffn_dim) if config.shared_expert_ffn_dim else None
        self.dispatcher = LocalDispatcher(config.num_experts)
        self.groups = TokenGroups()
        self.loss_scale = 1.0
        self.counting = True  # off while a pipeline stage infers shapes on stand-in tensors
        self.reset_stats()

    def reset_stats(self) -> None:
        """Starts new logging counters: this rank's share of the balancing losses, tokens routed
        to each expert (before dropping), assignments routed and dropped."""
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(batch * seq, dim)
        routing = self.router(tokens, batch, seq, self.groups)
        loss = None
        # Balancing and its statistics are about training steps: not evaluation, not shape
        # inference on stand-in tensors.
        if self.training and torch.is_grad_enabled() and self.counting:
            loss = balancing_loss(routing, self.config, batch, seq, self.groups)
            self._record(routing, loss)
        rows, counts, state = self.dispatcher.dispatch(tokens, routing.ids, routing.keep)
        expert_out = self.experts(rows, counts)
        out = self.dispatcher.combine(expert_out.to(x.dtype), routing.probs, state).view(batch, seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if loss is not None:
            out = _AttachLoss.apply(out, loss, self.loss_scale)
        return out

    @torch.no_grad()
    def _record(self, routing: Routing, loss: torch.Tensor | None) -> None:
        if torch._C._current_graph_task_id() != -1:  # recomputed in backward: counted already
            return
        chosen = torch.bincount(routing.ids.reshape(-1), minlength=self.config.num_experts).float()
        if self.config.expert_bias:
            self.router.tokens_per_expert += chosen
        dropped = (~routing.keep).sum().float() if routing.keep is not None else chosen.new_zeros(())
        new = {"load": chosen, "dropped": dropped, "routed": chosen.new_tensor(float(routing.ids.numel())),
               "loss": loss.detach() if loss is not None else chosen.new_zeros(())}
        for key, value in new.items():
            self.stats[key] = self.stats[key] + value if key in self.stats else value


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(FQN, module) of every dtmega MoE feed-forward in `model`."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def update_expert_bias(model: nn.Module, all_reduce=None) -> None:
    """After an optimizer step: moves every expert bias towards balance using the step's token
    counts (summed over ranks by `all_reduce(tensor)` when given), then clears the counts."""
    for _, moe in moe_layers(model):
        if not moe.config.expert_bias:
            continue
        counts = moe.router.tokens_per_expert.clone()
        if all_reduce is not None:
            counts = all_reduce(counts)
        moe.router.update_bias(counts)
        moe.router.tokens_per_expert.zero_()
