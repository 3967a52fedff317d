"""dtmega.passes: the compiler. The layout IR, the pass protocol and manager, plans, model
families and their rule sets, and the standard passes."""

from dtmega.passes.attention_backend import AttentionBackend
from dtmega.passes.axes import MeshAxes
from dtmega.passes.base import Pass
from dtmega.passes.compile import Compile
from dtmega.passes.context_parallel import ContextParallel
from dtmega.passes.data_parallel import DataParallel
from dtmega.passes.document_masking import DocumentMasking
from dtmega.passes.errors import PlanError
from dtmega.passes.expert_parallel import ExpertParallel
from dtmega.passes.families import ModelFacts, ModelFamily, family_of, register_family
from dtmega.passes.float8 import Float8
from dtmega.passes.fuse_kernels import FuseKernels
from dtmega.passes.layout import Layout, LayoutChange, ModuleLayout, ParamLayout
from dtmega.passes.manager import PassManager
from dtmega.passes.pipeline import PipelineSplit
from dtmega.passes.plan import Plan
from dtmega.passes.program import Program
from dtmega.passes.recompute import Recompute
from dtmega.passes.results import (
    Compilation,
    ContextSharding,
    DataParallelism,
    ExpertPlacement,
    PassResult,
    PipelineStages,
    TensorParallelism,
)
from dtmega.passes.rules import Rule
from dtmega.passes.runtime import Batch, Executor, RuntimeHook, StepContext
from dtmega.passes.sequence_parallel import SequenceParallel
from dtmega.passes.tensor_parallel import TensorParallel
from dtmega.passes.tp_styles import Style, apply_styles, register_style, register_style_variant, style
from dtmega.passes.workload import Workload

__all__ = [
    "AttentionBackend", "Batch", "Compilation", "Compile", "ContextParallel", "ContextSharding", "DataParallel",
    "DataParallelism", "DocumentMasking",
    "ExpertParallel", "ExpertPlacement", "Executor", "Float8", "FuseKernels", "Layout", "LayoutChange", "MeshAxes",
    "ModelFacts", "ModelFamily",
    "ModuleLayout", "ParamLayout", "Pass", "PassManager", "PassResult", "PipelineSplit", "PipelineStages", "Plan",
    "PlanError", "Program", "Recompute", "Rule", "RuntimeHook", "SequenceParallel", "StepContext", "Style",
    "TensorParallel", "TensorParallelism", "Workload", "apply_styles", "family_of", "register_family", "register_style",
    "register_style_variant", "style",
]
