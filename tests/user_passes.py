"""A researcher's pass that shards the embedding table over an axis of its choosing (vocab
rows, partial lookups all-reduced): a model-parallel use of that axis, whatever its name."""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.passes import Pass, Program, apply_styles, style


@dataclass
class EmbeddingOverAxis(Pass):
    """The embedding's rows split over `axis`; every rank along it must see the same tokens."""

    axis: str = "dp_shard"

    def annotate(self, program: Program) -> None:
        size = program.axis_size(self.axis)
        fqn = program.facts.embedding
        entry = program.layout[fqn]
        entry.style = "embedding"
        style("embedding", "tensor_parallel").annotate(entry, program.modules[fqn], self.axis, size, {})

    def apply(self, program: Program) -> None:
        apply_styles(program, "tensor_parallel", self.axis)


# ---- a loss of one's own, reading a per-token field of the batch -------------------------------
TOKEN_WEIGHTED = "cross_entropy.token_weighted"


def token_weighted_sum(owner, logits, batch):
    """Cross entropy weighted per token by the batch's `token_weight` field, summed over loss tokens."""
    from dtmega.kernels import per_token_cross_entropy

    return (per_token_cross_entropy(logits, batch.labels) * batch.loss_mask * batch.extra["token_weight"]).sum()


@dataclass
class TokenWeightedLoss(Pass):
    """Trains on cross entropy weighted per token (`make_batch(..., token_weight=w)`): the output
    module's kernel names the registered loss, which declares the field it reads."""

    def annotate(self, program: Program) -> None:
        program.layout[program.facts.output].kernel = TOKEN_WEIGHTED

    def apply(self, program: Program) -> None:
        pass


def _register() -> None:
    from dtmega.kernels.registry import KernelSpec, register_kernel
    from dtmega.passes.loss import Loss, register_loss

    register_kernel(KernelSpec(TOKEN_WEIGHTED, "cross_entropy", "cross entropy weighted per token"), replace=True)
    register_loss(TOKEN_WEIGHTED, lambda program: Loss(token_weighted_sum, fields=("token_weight",)))


_register()


# ---- data-parallel units of one's own: FSDP on the later blocks only -------------------------
@dataclass
class LaterBlocksAsUnits(Pass):
    """Only the blocks from `first` on become data-parallel units (the earlier blocks' weights
    stay in the root's unit); DataParallel, after it, builds the units the layout names."""

    first: int = 1
    mode: str = "fsdp"

    def mesh_axes(self) -> tuple[str, ...]:
        return ()

    def annotate(self, program: Program) -> None:
        for block in program.blocks()[self.first:]:
            program.layout[block].wrap = self.mode

    def apply(self, program: Program) -> None:
        pass
