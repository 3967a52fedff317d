"""dtmega.passes: the compiler. The layout IR, the pass protocol and manager, plans, model
families and their rule sets, and the standard passes."""

from dtmega.passes.base import Pass
from dtmega.passes.context_parallel import ContextParallel
from dtmega.passes.data_parallel import DataParallel
from dtmega.passes.errors import PlanError
from dtmega.passes.expert_parallel import ExpertParallel
from dtmega.passes.families import ModelFacts, ModelFamily, family_of, register_family
from dtmega.passes.layout import Layout, LayoutChange, ModuleLayout, ParamLayout
from dtmega.passes.manager import PassManager
from dtmega.passes.pipeline import PipelineSplit
from dtmega.passes.plan import Plan
from dtmega.passes.program import Program
from dtmega.passes.recompute import Recompute
from dtmega.passes.rules import Rule
from dtmega.passes.sequence_parallel import SequenceParallel
from dtmega.passes.tensor_parallel import TensorParallel

__all__ = [
    "ContextParallel", "DataParallel", "ExpertParallel", "Layout", "LayoutChange", "ModelFacts", "ModelFamily", "ModuleLayout",
    "ParamLayout", "Pass", "PassManager", "PipelineSplit", "Plan", "PlanError", "Program", "Recompute", "Rule",
    "SequenceParallel", "TensorParallel", "family_of", "register_family",
]
