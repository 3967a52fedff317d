"""Weights of a parallelized model: sharding-invariant initialization, loading and gathering
unsharded state dicts, and resharding FSDP roots after a no-grad forward."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import FSDPModule


class ModelWeights:
    """Mixed into ParallelModel (which provides `parts`, `module` and `mesh`)."""

    def init_weights(self, seed: int = 0, device: torch.device | str | None = None) -> None:
        """Materializes meta parameters on `device` and initializes them; the values equal the
        unsharded model's `init_weights(seed)` whatever the plan."""
        if device is None:
            device = self.mesh.device_type if self.mesh is not None else "cpu"
        for part in self.parts:
            if any(p.is_meta for p in part.parameters()) or any(b.is_meta for b in part.buffers()):
                part.to_empty(device=device)
            init = getattr(part, "init_weights", None)
            if init is None:
                raise NotImplementedError(
                    f"{type(part).__name__} has no init_weights(seed, buffer_device); load weights "
                    "with load_full_state_dict instead"
                )
            init(seed=seed, buffer_device=torch.device(device))
        self._tag_tied_copy()

    def materialize(self, device: torch.device | str | None = None) -> None:
        """Allocates meta parameters on `device` uninitialized and builds the buffers (the model's
        `init_buffers(device)`, which also re-ties what `to_empty` untied): for weights loaded
        next (a checkpoint), so no time or memory goes to random values. A model without
        `init_buffers` is initialized instead (`init_weights(seed=0)`)."""
        if device is None:
            device = self.mesh.device_type if self.mesh is not None else "cpu"
        if not all(hasattr(part, "init_buffers") for part in self.parts):
            self.init_weights(seed=0, device=device)
            return
        for part in self.parts:
            if any(p.is_meta for p in part.parameters()) or any(b.is_meta for b in part.buffers()):
                part.to_empty(device=device)
            part.init_buffers(torch.device(device))
        self._tag_tied_copy()

    def _tag_tied_copy(self) -> None:
        """Tags a pipeline's last-stage copy of a tied embedding again: `to_empty` swaps each
        parameter's contents, attributes included (checkpoints hold the tied weight once, and
        recognise the copy by its tag: dtmega/train/tied_state.py)."""
        tied = getattr(getattr(self, "executor", None), "tied", None)
        if tied is not None:
            tied.mark()

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads unsharded weights (every rank passes the same dict); each rank keeps its shard."""
        set_model_state_dict(self.module, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights, gathered on every rank (small models, tests, export)."""
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))

    def reshard(self) -> None:
        """Reshards every FSDP unit. FSDP2 leaves the root gathered after a no-grad forward (the
        root never reshards after forward), so `parameters()` would list the gathered tensors,
        not the sharded ones the optimizer holds, until the next backward."""
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def runtime_state_dict(self) -> dict[str, torch.Tensor]:
        """The hooks' checkpointed state (FP8 amax histories and scales, ...)."""
        return {key: value for hook in self.hooks for key, value in hook.state_dict().items()}

    def load_runtime_state_dict(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Restores the hooks whose state `state` holds; returns the keys it lacked (a checkpoint
        written without that hook, e.g. without FP8: those hooks start fresh)."""
        missing = []
        for hook in self.hooks:
            wanted = hook.state_dict()
            absent = [key for key in wanted if key not in state]
            if absent:
                missing += absent
                continue
            if wanted:
                hook.load_state_dict(state)
        return missing
