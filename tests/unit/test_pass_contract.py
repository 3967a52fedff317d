"""The pass contract from outside the package: a pass defined here (no edit to dtmega/) chooses a
kernel of its own for some modules and adds a post-optimizer hook; the report shows its kernel,
the model still equals the unsharded one, and the hook runs after every optimizer step. Also:
typed results (no string-keyed state), axes a plan names itself, workload-aware checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import dtmega
from dtmega.kernels import KernelSpec, register_kernel
from dtmega.passes import (
    ContextParallel,
    DataParallel,
    Pass,
    Plan,
    PlanError,
    Program,
    RuntimeHook,
    TensorParallel,
    Workload,
)
from dtmega.passes.results import DataParallelism, TensorParallelism
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama

register_kernel(KernelSpec("rms_norm.test_explicit", "rms_norm", "RMSNorm written out op by op (a test kernel)",
                           reference="rms_norm.torch"), replace=True)
register_kernel(KernelSpec("rms_norm.torch", "rms_norm", "torch.nn.RMSNorm"), replace=True)


def explicit_rms_norm(module: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight


class CountOptimizerSteps(RuntimeHook):
    def __init__(self):
        self.steps = 0

    def after_optimizer_step(self) -> None:
        self.steps += 1


@dataclass
class ExplicitNorms(Pass):
    """Runs every RMSNorm through the test kernel; counts optimizer steps."""

    provides = ("explicit_norms",)

    def annotate(self, program: Program) -> None:
        for fqn, module in program.modules.items():
            if isinstance(module, nn.RMSNorm):
                program.layout[fqn].kernel = "rms_norm.test_explicit"

    def apply(self, program: Program) -> None:
        for fqn, entry in program.layout.modules.items():
            if entry.kernel == "rms_norm.test_explicit":
                for module in program.modules_at(fqn):
                    module.forward = lambda x, module=module: explicit_rms_norm(module, x)
        program.add_hook(CountOptimizerSteps())


def test_a_pass_from_outside_adds_a_kernel_and_a_post_optimizer_hook(capsys):
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=3)
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(device_type="cpu"), Plan([ExplicitNorms(), DataParallel()]))
    pm.init_weights(seed=3)
    assert pm.layout["layers.0.attention_norm"].kernel == "rms_norm.test_explicit"
    dtmega.console(leader=True).print(pm.report())
    assert "rms_norm.test_explicit" in capsys.readouterr().out
    assert_close_to_reference(compare_training(reference, pm, steps=3))
    assert pm.hook(CountOptimizerSteps).steps == 3  # compare_training steps the optimizer 3 times


def test_an_unknown_or_unavailable_kernel_is_refused_before_anything_is_built():
    @dataclass
    class Unknown(ExplicitNorms):
        def annotate(self, program: Program) -> None:
            program.layout["norm"].kernel = "rms_norm.nowhere"

    with pytest.raises(PlanError, match="no kernel named 'rms_norm.nowhere'"):
        dtmega.check_plan(debug_model(), {}, Plan([Unknown()]))
    register_kernel(KernelSpec("rms_norm.gpu_only", "rms_norm", "a CUDA-only test kernel", devices=("cuda",)),
                    replace=True)

    @dataclass
    class GpuOnly(ExplicitNorms):
        def annotate(self, program: Program) -> None:
            program.layout["norm"].kernel = "rms_norm.gpu_only"

    dtmega.check_plan(debug_model(), {}, Plan([GpuOnly()]))  # no device yet: fine
    with pytest.raises(PlanError, match="runs on cuda, not cpu"):
        dtmega.parallelize(debug_model(), dtmega.make_mesh(device_type="cpu"), Plan([GpuOnly()]))


def debug_model() -> nn.Module:
    with torch.device("meta"):
        return dtmega.models.Llama(debug_llama())


def test_passes_leave_typed_results_not_strings():
    with torch.device("meta"):
        model = dtmega.models.Llama(debug_llama())
    program = Program.build(model, {"tp": 2, "dp_shard": 2})
    dtmega.passes.PassManager([TensorParallel(), DataParallel("fsdp")]).annotate(program)
    assert program.result(TensorParallelism) == TensorParallelism("tp", 2)
    assert program.result(DataParallelism).mode == "fsdp" and not hasattr(program, "state")
    assert program.layout.to_dict()["results"]["TensorParallelism"] == {"axis": "tp", "size": 2}


def test_a_plan_may_name_its_own_axes():
    layout = dtmega.check_plan(debug_model(), {"model": 2, "data": 2},
                               Plan([TensorParallel(axis="model"), DataParallel("fsdp", shard_axis="data")]))
    assert layout["layers.0.attention.wq"].params["weight"].placements == {"model": "S(0)", "data": "S(0)"}
    with pytest.raises(PlanError, match="uses axis 'x' for tensor parallelism, but TensorParallel uses 'model'"):
        dtmega.check_plan(debug_model(), {"model": 2, "x": 1},
                          Plan([TensorParallel(axis="model"), ExplicitTensor(axis="x")]))


@dataclass
class ExplicitTensor(Pass):
    axis: str = "x"
    role = "tensor"

    def annotate(self, program: Program) -> None:
        pass


def test_workload_checks_run_before_launch():
    plan = Plan([ContextParallel(), DataParallel("ddp")])
    dtmega.check_plan(debug_model(), {"cp": 2}, plan, workload=Workload(seq_len=64))
    with pytest.raises(PlanError, match="sequence length 30 is not divisible by 2 x cp = 4"):
        dtmega.check_plan(debug_model(), {"cp": 2}, plan, workload=Workload(seq_len=30))
    with pytest.raises(PlanError, match="longer than the model's position table"):
        dtmega.check_plan(debug_model(), {}, Plan([]), workload=Workload(seq_len=4096))


def test_compiled_blocks_on_a_gpu_leave_norms_to_the_compiler():
    from dtmega.passes import Compile, FuseKernels

    plan = Plan([FuseKernels(impl="triton"), DataParallel(), Compile()])
    layout = dtmega.check_plan(debug_model(), {}, plan)
    assert layout["norm"].kernel is None and layout["layers.0.feed_forward.act"].kernel is None
    assert layout["output"].kernel == "cross_entropy.fused_linear.triton"
    forced = dtmega.check_plan(debug_model(), {}, Plan([FuseKernels(impl="triton", rms_norm=True), DataParallel(),
                                                        Compile()]))
    assert forced["norm"].kernel == "rms_norm.triton" and forced["layers.0.feed_forward.act"].kernel is None
    eager = dtmega.check_plan(debug_model(), {}, Plan([FuseKernels(impl="triton"), DataParallel()]))
    assert eager["norm"].kernel == "rms_norm.triton" and eager["layers.0.attention.rotary"].kernel == "rope.triton"
