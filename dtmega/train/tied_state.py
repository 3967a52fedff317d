"""A checkpoint holds a tied weight once (as Megatron's holds its word embedding once): the
output layer of a tied model, and a pipeline's last-stage copy of the first stage's embedding
(passes/tied_embeddings.py), are left out of what is saved, and filled from the weight they copy
when loading. Their optimizer state (the same as the weight's: both copies take the same steps)
is left out and filled the same way. Checkpoints written before, which hold the copy too, load
as well (the copy's own entry is not read)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dtmega.passes.tied_embeddings import TIED_COPY


def _storage(tensor: Any) -> int | None:
    """The address of the memory a tensor's (local) values live in: a wrapper subclass (an FP8
    weight's) by the tensor it wraps; None for empty shards (they share no storage) and for
    tensors whose storage cannot be read."""
    if not isinstance(tensor, torch.Tensor):
        return None
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    while type(local) not in (torch.Tensor, torch.nn.Parameter) and hasattr(local, "__tensor_flatten__"):
        inner, _ = local.__tensor_flatten__()
        local = getattr(local, inner[0])
    if not local.numel():
        return None
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # a subclass without storage of its own
        return None


def tied_copies(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, str]:
    """{key of a copy in the model's `state`: key of the weight it copies}: a parameter tagged as
    a pipeline stage's copy (TIED_COPY names its weight), and a parameter listed twice on this
    rank (a tied model's output layer: the first name is the weight's)."""
    params, tagged = set(), {}
    for param in model.parameters():
        storage = _storage(param)
        params.add(storage)
        if isinstance(owner := getattr(param, TIED_COPY, None), str):
            tagged[storage] = owner
    params.discard(None)
    copies, first = {}, {}
    for key, value in state.items():
        storage = _storage(value)
        if storage is None or storage not in params:
            continue
        if storage in tagged and key != tagged[storage]:
            copies[key] = tagged[storage]
        elif storage in first:
            copies[key] = first[storage]
        else:
            first[storage] = key
    return copies


def drop_copies(model_state: dict[str, Any], optimizer_state: dict[str, Any] | None, copies: dict[str, str]) -> None:
    """Leaves the copies (and their optimizer entries) out of what is saved."""
    for copy in copies:
        model_state.pop(copy, None)
        for key in [k for k in optimizer_state or {} if _of(k, copy)]:
            del optimizer_state[key]


def _of(key: str, name: str) -> bool:
    """Whether a flattened optimizer-state key (state.<fqn>.<field>, param_groups.<fqn>.<field>)
    belongs to parameter `name`."""
    return any(key.startswith(f"{prefix}.{name}.") for prefix in ("state", "param_groups"))


def read_copies_as_their_weights(state: dict[str, Any], copies: dict[str, str]) -> list[tuple[str, str, Any]]:
    """Before loading `state` (a model's, or a flattened optimizer state): each copy's entries
    are read from its weight's. Where this rank holds no entry of the weight's name (a pipeline's
    last stage), the copy's tensor moves under that name and is loaded in place; where it does,
    the copy's entry waits and takes the weight's values after loading. Returns what
    `fill_copies` undoes: (copy key, weight key, the waiting value or None when moved)."""
    plan = []
    for copy, owner in copies.items():
        for key in [k for k in state if k == copy or _of(k, copy)]:
            target = owner if key == copy else key.replace(f".{copy}.", f".{owner}.", 1)
            value = state.pop(key)
            if target in state:
                plan.append((key, target, value))
            else:
                state[target] = value
                plan.append((key, target, None))
    return plan


@torch.no_grad()
def fill_copies(state: dict[str, Any], plan: list[tuple[str, str, Any]]) -> None:
    """After loading: each copy's entry back under its own key, holding its weight's values."""
    for key, target, waiting in plan:
        if waiting is None:
            state[key] = state.pop(target)
        elif isinstance(waiting, torch.Tensor) and isinstance(state[target], torch.Tensor):
            waiting.copy_(state[target])
            state[key] = waiting
        else:
            state[key] = state[target]
