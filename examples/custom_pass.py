"""A researcher's sharding layout as a pass: tensor parallelism on the MLPs only.

    torchrun --nproc-per-node 2 examples/custom_pass.py
"""

from dataclasses import dataclass

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import Pass, Plan, PlanError, Program

MLP = {"w1": ("colwise", "S(0)"), "w3": ("colwise", "S(0)"), "w2": ("rowwise", "S(1)")}


@dataclass
class MLPTensorParallel(Pass):
    """Column-parallel w1/w3, row-parallel w2 in every block; attention stays replicated."""

    axis: str = "tp"
    provides = ("tensor_parallel@{axis}",)

    def annotate(self, program: Program) -> None:  # pure: checks and writes the layout
        size = program.axis_size(self.axis)
        if program.facts.ffn_dim % size:
            raise PlanError(f"ffn_dim={program.facts.ffn_dim} is not divisible by {self.axis}={size}")
        for block in program.blocks():
            for name, (style, placement) in MLP.items():
                entry = program.layout[f"{block}.feed_forward.{name}"]
                entry.style = style
                entry.params["weight"].placements[self.axis] = placement
                colwise = style == "colwise"
                entry.inputs[self.axis] = "R" if colwise else "S(-1)"
                entry.outputs[self.axis] = "S(-1)" if colwise else "P->R"

    def apply(self, program: Program) -> None:  # materializes what annotate wrote
        mesh = program.submesh(self.axis)
        for fqn, entry in program.layout.modules.items():
            if entry.style in ("colwise", "rowwise") and self.axis in entry.inputs:
                style = ColwiseParallel() if entry.style == "colwise" else RowwiseParallel()
                parallelize_module(program.module(fqn), mesh, style, src_data_rank=None)


if __name__ == "__main__":
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("debug"))
    pm = dtmega.parallelize(model, dtmega.make_mesh(tp=-1, dp_shard=1), Plan([MLPTensorParallel()]))
    pm.init_weights(seed=0)
    loss = pm.forward_backward(dtmega.synthetic_batch(4, 32, 256))
    dtmega.console().print(pm.layout["layers.0.feed_forward.w2"], f"loss {loss.item():.4f}")  # rank 0 prints
