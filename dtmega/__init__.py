"""dtmega: Megatron-LM's large-scale LLM training, rebuilt PyTorch-native.

    mesh = dtmega.make_mesh(dp_shard=2, tp=2)
    plan = dtmega.Plan([TensorParallel(), SequenceParallel(), DataParallel("fsdp")])
    pm = dtmega.parallelize(Llama(cfg), mesh, plan)

Names are imported on first use, so `dtmega preprocess` (and its worker processes) never pay
for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "DtmegaError": "dtmega.kernels.errors",
    "console": "dtmega.printing",
    "make_batch": "dtmega.batch",
    "synthetic_batch": "dtmega.batch",
    "document_ids_from_lengths": "dtmega.kernels.document_attention",
    "document_ids_from_eod": "dtmega.kernels.document_attention",
    "init_distributed": "dtmega.mesh",
    "make_mesh": "dtmega.mesh",
    "simulate_world": "dtmega.mesh",
    "split_world": "dtmega.mesh",
    "ParallelModel": "dtmega.parallel_model",
    "check_plan": "dtmega.parallelizer",
    "capture_step": "dtmega.step_capture",
    "parallelize": "dtmega.parallelizer",
    "Layout": "dtmega.passes",
    "Plan": "dtmega.passes",
    "PlanError": "dtmega.passes",
    "Workload": "dtmega.passes",
    "Hardware": "dtmega.cost.hardware",
    "load_hardware": "dtmega.cost.hardware",
    "CostEstimate": "dtmega.cost.estimate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        importlib.import_module("dtmega.models")  # registers the reference models' rule sets
        value = globals()[name] = getattr(module, name)
        return value
    if name in ("models", "passes", "kernels", "data", "train", "cost"):
        return importlib.import_module(f"dtmega.{name}")
    raise AttributeError(f"module 'dtmega' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "models", "passes", "kernels", "data", "train", "cost", "__version__"])
