"""Tied embeddings across pipeline stages, as Megatron does it: the first stage holds the word
embedding, the last a copy as its output layer (initialized equal: `InitSpec.key`), and after every
backward the two gradients are summed between the two ranks that hold them (the ranks of stage 0
and the last stage with the same other coordinates: Megatron's embedding group, here a point-to-
point exchange over the pipeline group), so both copies take the same step and stay equal. Under
tensor parallelism both copies are vocab-sharded alike, under FSDP sharded alike, so the local
shards line up. The copy is left out of gradient norms (`TIED_COPY`, Megatron's `param.shared`):
the tied matrix is counted once, by its owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# attribute set on the last stage's copy, naming the weight it copies: norms skip it (the
# embedding counts the tied matrix once) and checkpoints hold only the weight it copies
TIED_COPY = "dtmega_tied_copy"


def tied_embedding_name(model: nn.Module, output: str) -> str | None:
    """The name of the parameter the output layer's weight is tied to (None: untied)."""
    weight = model.get_submodule(output).weight
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is weight and name != f"{output}.weight":
            return name
    return None


def embedding_peer(mesh, axis: str, first: int, last: int) -> int | None:
    """The global rank that holds this rank's other tied copy: in this rank's slice of the mesh
    along the pipeline axis, the rank at pipeline coordinate `last` for the first stage's rank and
    `first` for the last's. None when one rank holds both stages or this rank neither. The two
    exchange gradients point to point over the pipeline group: no process group of their own (one
    made by its two members alone takes a name from each rank's history of groups, which can
    differ, and then never forms)."""
    if first == last:
        return None
    names = list(mesh.mesh_dim_names)
    rows = mesh.mesh.movedim(names.index(axis), -1).reshape(-1, mesh.mesh.shape[names.index(axis)])
    me = dist.get_rank()
    for row in rows.tolist():
        if me == row[first]:
            return row[last]
        if me == row[last]:
            return row[first]
    return None


class TiedEmbeddingSync:
    """Sums the tied copies' gradients after each backward (see the module docstring)."""

    def __init__(self, embedding: nn.Module | None, output: nn.Module | None, name: str, peer: int | None, group):
        self.embedding, self.output, self.name, self.peer, self.group = embedding, output, name, peer, group

    def _params(self) -> list[torch.nn.Parameter]:
        found = []
        if self.embedding is not None:
            found.append(self.embedding.get_parameter(self.name.rpartition(".")[2]))
        if self.output is not None:
            found.append(self.mark())
        return found

    def mark(self) -> torch.nn.Parameter | None:
        """Tags the output layer's weight (as it is now: data parallelism replaces parameters) as
        the copy of the tied weight `name`; returns it (None on a rank without the last stage)."""
        if self.output is None:
            return None
        copy = self.output.weight
        setattr(copy, TIED_COPY, self.name)
        return copy

    @torch.no_grad()
    def sync(self) -> None:
        """After backward: both copies' gradients become their sum."""
        params = self._params()
        if any(p.grad is None for p in params):
            raise RuntimeError("a tied embedding copy has no gradient after backward; every micro-batch passes "
                               "through the embedding and the output layer")
        for p in params:  # a vocab-parallel lookup's gradient may arrive in another layout than its weight's
            if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(placements=p.placements)
        grads = [p.grad for p in params]
        local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
        if len(local) == 2:  # one rank holds both stages
            local[0].add_(local[1])
            local[1].copy_(local[0])
        if self.peer is not None:  # the first stage's rank receives, adds and sends the sum back
            (mine,) = local
            if self.embedding is not None:
                theirs = torch.empty_like(mine)
                dist.recv(theirs, src=self.peer, group=self.group)
                mine.add_(theirs)
                dist.send(mine, dst=self.peer, group=self.group)
            else:
                dist.send(mine, dst=self.peer, group=self.group)
                dist.recv(mine, src=self.peer, group=self.group)
