"""A researcher's sharding layout as a pass: tensor parallelism on the MLPs only.

    torchrun --nproc-per-node 2 examples/custom_pass.py

The public route: `annotate` picks registered styles and lets each write the layout entry;
`apply` materializes whatever the layout says with `apply_styles`. So a pass that runs after
this one (SequenceParallel turns the row-wise outputs into reduce-scatters) changes what is
built, and the sharded model always matches its layout.
"""

from dataclasses import dataclass

import torch

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import Pass, Plan, PlanError, Program, SequenceParallel, apply_styles, style

MLP = {"w1": "colwise", "w3": "colwise", "w2": "rowwise"}


@dataclass
class MLPTensorParallel(Pass):
    """Column-parallel w1/w3, row-parallel w2 in every block; attention stays replicated."""

    axis: str = "tp"
    provides = ("tensor_parallel@{axis}",)  # so SequenceParallel(axis="tp") may follow it
    role = "tensor"

    def annotate(self, program: Program) -> None:  # pure: checks and writes the layout
        size = program.axis_size(self.axis)
        if program.facts.ffn_dim % size:
            raise PlanError(f"ffn_dim={program.facts.ffn_dim} is not divisible by {self.axis}={size}. "
                            f"Fix: a {self.axis} size that divides it")
        for block in program.blocks():
            for name, kind in MLP.items():
                fqn = f"{block}.feed_forward.{name}"
                entry = program.layout[fqn]
                entry.style = kind
                style(kind, "tensor_parallel").annotate(entry, program.modules[fqn], self.axis, size, {})

    def apply(self, program: Program) -> None:  # materializes what the layout says
        apply_styles(program, "tensor_parallel", self.axis)


if __name__ == "__main__":
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("debug"))
    plan = Plan([MLPTensorParallel(), SequenceParallel()])
    pm = dtmega.parallelize(model, dtmega.make_mesh(tp=-1, dp_shard=1), plan)
    pm.init_weights(seed=0)
    loss = pm.forward_backward(dtmega.synthetic_batch(4, 32, 256))
    dtmega.console().print(pm.layout["layers.0.feed_forward.w2"], f"loss {loss.item():.4f}")  # rank 0 prints
