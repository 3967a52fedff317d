"""FP8 scaling state and per-tensor scales: delayed scaling's amax histories (one `Float8State`
per linear), their step update, and the scale of a tensor under a per-tensor recipe. Below both
the FP8 linear and the FP8 all-gather of weights, which cast with the same scales."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtmega.kernels.errors import DtmegaError
from dtmega.kernels.float8 import Float8Recipe, amax, scale_from_amax

X, W, G = 0, 1, 2  # the three tensors an FP8 linear scales: input, weight, output gradient


class Float8State:
    """Delayed scaling's state of one linear: amax history [3, history] (row 0 of each is the
    newest), the scales in use [3], and this step's local amaxes [3]."""

    def __init__(self, history_len: int, device: torch.device | str = "cpu"):
        self.history = torch.zeros(3, history_len, device=device)
        self.scale = torch.ones(3, device=device)
        self.current = torch.zeros(3, device=device)
        # Before the first update there is no history: that step scales by its own amaxes
        # (current scaling) instead of by 1, which would under- or overflow most values.
        self.ready = False

    def record(self, index: int, value: torch.Tensor) -> None:
        """Keeps the largest amax of tensor `index` seen this step (micro-batches, recompute)."""
        self.current[index] = torch.maximum(self.current[index], value.to(self.current.device))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"amax_history": self.history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["amax_history"].shape != self.history.shape:
            raise DtmegaError(f"FP8 amax history of shape {tuple(state['amax_history'].shape)} cannot replace one of "
                             f"{tuple(self.history.shape)}: the run's --fp8-amax-history-len differs")
        self.history.copy_(state["amax_history"])
        self.scale.copy_(state["scale"])
        self.ready = True


def reduce_max(value: torch.Tensor, group) -> torch.Tensor:
    """`value` all-reduced (MAX, in place) over `group`; unchanged when the group is None or one rank."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


@torch.no_grad()
def reduce_and_update_scales(states: list[Float8State], recipe: Float8Recipe, group) -> None:
    """After a step: reduce every state's step amaxes over `group` in one collective, push them
    into the histories, compute the scales the next step uses, and clear the step's amaxes.

    All linears at once: stacked, updated with a few vectorized ops, written back with
    `_foreach_copy_`: a loop per linear costs ~20 small kernel launches each (2,240 per step
    for the 112 FP8 linears of a 1.5 B Llama), which a GPU step notices."""
    if not states:
        return
    current = reduce_max(torch.stack([s.current for s in states]), group)  # [n, 3]
    history = torch.roll(torch.stack([s.history for s in states]), 1, dims=2)  # [n, 3, H], newest at 0
    history[:, :, 0] = current
    basis = history.max(dim=2).values if recipe.amax_compute_algo == "max" else history[:, :, 0]
    previous = torch.stack([s.scale for s in states])
    # Columns X and W take the forward format's range, G the backward's.
    scale = torch.cat([scale_from_amax(basis[:, :G], recipe.forward_dtype, recipe.margin, previous[:, :G]),
                       scale_from_amax(basis[:, G:], recipe.backward_dtype, recipe.margin, previous[:, G:])], dim=1)
    torch._foreach_copy_([s.history for s in states], list(history.unbind(0)))
    torch._foreach_copy_([s.scale for s in states], list(scale.unbind(0)))
    torch._foreach_zero_([s.current for s in states])
    for state in states:
        state.ready = True


def tensor_scale(t: torch.Tensor, index: int, dtype, recipe: Float8Recipe, state: Float8State | None, group,
                 record: bool):
    """The scale of `t` (tensor `index` of the linear: X, W or G) under a per-tensor recipe:
    delayed scaling's current scale once it has a history, else max_fp8 / amax of `t` reduced
    over `group` (the whole tensor's). Delayed scaling adds t's amax to the step's when
    `record` (a training pass on real data). FP8 all-gather casts weight shards with it too."""
    if recipe.scaling == "delayed":
        if record:
            state.record(index, amax(t))
        if state.ready:
            return state.scale[index].to(t.device)
    return scale_from_amax(reduce_max(amax(t), group), dtype, recipe.margin)
