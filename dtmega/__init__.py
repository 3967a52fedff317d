"""dtmega: Megatron-LM's large-scale LLM training, rebuilt PyTorch-native.

    mesh = dtmega.make_mesh(dp_shard=2, tp=2)
    plan = dtmega.Plan([TensorParallel(), SequenceParallel(), DataParallel("fsdp")])
    pm = dtmega.parallelize(Llama(cfg), mesh, plan)
"""

from dtmega.batch import make_batch, synthetic_batch
from dtmega.mesh import init_distributed, make_mesh, simulate_world, split_world
from dtmega.parallel_model import ParallelModel
from dtmega.parallelize import check_plan, parallelize
from dtmega.passes import Layout, Plan, PlanError
from dtmega import models  # noqa: F401  (registers the reference models' rule sets)

__version__ = "0.1.0"

__all__ = [
    "Layout", "ParallelModel", "Plan", "PlanError", "check_plan", "init_distributed", "make_batch",
    "make_mesh", "parallelize", "simulate_world", "split_world", "synthetic_batch",
]
