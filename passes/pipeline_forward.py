"""Logits of a pipeline-split model for any batch: each stage's forward in stage order.

`pm(tokens)` must give the logits under every plan. A training schedule cannot: its stages'
buffers are sized for its micro-batches at first use, it demands as many micro-batches as
stages, and it ends in the loss. Here every rank of the pipeline runs its stages' forwards in
stage order on the whole batch, without gradients; stages exchange plain tensors (the pipeline
pass's boundary hooks make them so) with a small header giving shape and dtype, so any batch
shape works; the last stage's logits are then broadcast to every rank of the pipeline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# dtypes a stage boundary or the logits may carry, by their code in the header
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
HEADER = 8  # ndim, up to 6 sizes, dtype code


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > HEADER - 2 or tensor.dtype not in DTYPES:
        raise TypeError(f"a pipeline boundary tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype} "
                        "cannot be exchanged by the pipeline's forward")
    sizes = [*tensor.shape] + [0] * (HEADER - 2 - tensor.dim())
    return torch.tensor([tensor.dim(), *sizes, DTYPES.index(tensor.dtype)], dtype=torch.int64, device=tensor.device)


def _empty_from(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    ndim, *sizes, code = header.tolist()
    return torch.empty(sizes[:ndim], dtype=DTYPES[code], device=device)


def send_tensor(tensor: torch.Tensor, dst: int, group) -> None:
    """Sends `tensor` (shape and dtype first) to global rank `dst`."""
    dist.send(_header(tensor), dst, group=group)
    dist.send(tensor.contiguous(), dst, group=group)


def recv_tensor(src: int, group, device: torch.device) -> torch.Tensor:
    """Receives a tensor sent with `send_tensor` from global rank `src`."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    tensor = _empty_from(header, device)
    dist.recv(tensor, src, group=group)
    return tensor


def broadcast_tensor(tensor: torch.Tensor | None, src: int, group, device: torch.device) -> torch.Tensor:
    """`tensor` from global rank `src` on every rank of `group` (None on the others)."""
    header = _header(tensor) if tensor is not None else torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    if tensor is None:
        tensor = _empty_from(header, device)
    else:
        tensor = tensor.contiguous()
    dist.broadcast(tensor, src, group=group)
    return tensor


@torch.no_grad()
def pipeline_forward(parts: dict[int, nn.Module], rank_of_stage: tuple[int, ...], group, tokens: torch.Tensor,
                     kwargs: dict) -> torch.Tensor:
    """The last stage's output for `tokens` on every rank of the pipeline `group`.

    `parts` maps this rank's stage indices to their modules; `rank_of_stage[s]` is the pipeline
    rank holding stage s; `kwargs` (position ids) go to every stage, as the schedules pass them."""
    me = dist.get_rank(group)
    last = len(rank_of_stage) - 1
    hidden = None
    for stage, owner in enumerate(rank_of_stage):
        if owner != me:
            continue
        if stage == 0:
            hidden = parts[stage](tokens, **kwargs)
        else:
            if rank_of_stage[stage - 1] != me:  # else the previous stage ran here: its output is `hidden`
                hidden = recv_tensor(dist.get_global_rank(group, rank_of_stage[stage - 1]), group, tokens.device)
            hidden = parts[stage](hidden, **kwargs)
        if stage < last and rank_of_stage[stage + 1] != me:
            send_tensor(hidden, dist.get_global_rank(group, rank_of_stage[stage + 1]), group)
    source = dist.get_global_rank(group, rank_of_stage[last])
    return broadcast_tensor(hidden if rank_of_stage[last] == me else None, source, group, tokens.device)
