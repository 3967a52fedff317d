"""`dtmega train` with a plan file of one's own, launched on every rank through the trainer; rank 0
writes what the launch built as JSON: the plan it ran, the layout of an MLP and an attention
linear, each one's local weight shape, and the losses.

Run by tests/unit/test_custom_plan.py under `torchrun --nproc-per-node 2`, with the
`dtmega train` flags after the output path.
"""

import json
import sys

import torch.distributed as dist

from dtmega.train.args import parse_train_args
from dtmega.train.trainer import Trainer


def _local_shape(parameter) -> list[int]:
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    return list(local.shape)


out, argv = sys.argv[1], sys.argv[2:]
trainer = Trainer(*parse_train_args(argv))
result = trainer.run()
layout, module = trainer.pm.layout, trainer.pm.module
built = {
    "plan": trainer.plan.to_toml(),
    "losses": result.losses,
    "w1": {"style": layout["layers.0.feed_forward.w1"].style,
           "placements": layout["layers.0.feed_forward.w1"].params["weight"].placements,
           "local": _local_shape(module.get_parameter("layers.0.feed_forward.w1.weight"))},
    "wq": {"style": layout["layers.0.attention.wq"].style,
           "placements": layout["layers.0.attention.wq"].params["weight"].placements,
           "local": _local_shape(module.get_parameter("layers.0.attention.wq.weight"))},
}
if dist.get_rank() == 0:
    with open(out, "w") as handle:
        json.dump(built, handle)
