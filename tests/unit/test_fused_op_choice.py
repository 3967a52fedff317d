"""FuseKernels' kernels chosen by measurement inside compiled blocks (issue 36): with a fake timer
(the same logic a GPU's measurement drives), each in-block op keeps its fused kernel where it
beats inductor's code for the op and goes back to the compiled block where it loses; the layout
records each decision (the module's kernel, or none) and the notes every candidate's time; ops
switched on explicitly are not measured; without a timer or a GPU the rule measured on an H100
holds. The per-rank shapes measured follow the plan (SP's sequence shard, TP's FFN columns and
heads)."""

from __future__ import annotations

import torch

from dtmega.models import Llama
from dtmega.passes import Compile, FuseKernels, PassManager, Plan, Program, SequenceParallel, TensorParallel, Workload
from dtmega.passes.fused_op_timing import op_shapes
from tests.helpers import debug_llama, mesh_shape

TIMES = {("rms_norm", "triton"): 3.0, ("rms_norm", "inductor"): 2.0,
         ("rms_norm_residual", "triton"): 2.0, ("rms_norm_residual", "inductor"): 2.5,
         ("swiglu", "triton"): 1.0, ("swiglu", "inductor"): 1.5, ("rope", "triton"): 4.0, ("rope", "inductor"): 1.0}


def annotate(passes: list, sizes: dict, workload=Workload(seq_len=128, micro_batch=2)) -> Program:
    with torch.device("meta"):
        model = Llama(debug_llama(n_heads=8, n_kv_heads=4))
    program = Program.build(model, mesh_shape(**sizes), workload)
    PassManager(Plan(passes).passes).annotate(program)
    return program


def kernels(program: Program, suffix: str) -> set:
    return {entry.kernel for fqn, entry in program.layout.modules.items() if fqn.endswith(suffix)}


def test_each_op_keeps_its_kernel_only_where_it_measured_faster(tmp_path):
    calls = []

    def timer(op, candidate):
        calls.append((op, candidate))
        return TIMES[(op, candidate)]

    program = annotate([TensorParallel(), SequenceParallel(), FuseKernels(timer=timer, cache=str(tmp_path / "c.json")),
                        Compile("aot_eager")], dict(tp=2))
    assert kernels(program, "attention_norm") == {None}  # inductor faster: left to the compiled block
    assert kernels(program, "ffn_norm") == {"rms_norm_residual.reference"}  # the kernel faster: kept
    assert kernels(program, "feed_forward.act") == {"swiglu.reference"}
    assert kernels(program, "layers.0.attention.rotary") == {None}  # RoPE: inductor
    assert kernels(program, "output") == {"cross_entropy.fused_linear.reference"}  # the loss is not in a block
    note = next(line for line in program.log if line.startswith("FuseKernels: swiglu"))
    assert "swiglu T256 W" in note and "triton (1000.00 ms; inductor 1500.00)" in note
    assert sorted(calls) == sorted(TIMES)
    # a second plan reads the file: no measurement
    calls.clear()
    annotate([TensorParallel(), SequenceParallel(), FuseKernels(timer=timer, cache=str(tmp_path / "c.json")),
              Compile("aot_eager")], dict(tp=2))
    assert calls == []


def test_forced_ops_are_not_measured_and_eager_blocks_keep_every_kernel(tmp_path):
    calls = []

    def timer(op, candidate):
        calls.append(op)
        return TIMES[(op, candidate)]

    program = annotate([FuseKernels(rope=True, timer=timer, cache=str(tmp_path / "c.json")), Compile("aot_eager")], {})
    assert kernels(program, "layers.0.attention.rotary") == {"rope.reference"} and "rope" not in calls
    calls.clear()
    program = annotate([FuseKernels(timer=timer, cache=str(tmp_path / "d.json"))], {})  # not compiled: nothing competes
    assert kernels(program, "attention_norm") == {"rms_norm.reference"} and calls == []


def test_the_measured_shapes_follow_the_plan():
    program = annotate([TensorParallel(), SequenceParallel()], dict(tp=2))
    shapes = op_shapes(program)
    config = debug_llama(n_heads=8, n_kv_heads=4)
    assert (shapes["rms_norm"].tokens, shapes["rms_norm"].width) == (2 * 128 // 2, config.dim)  # SP: half the tokens
    assert (shapes["swiglu"].tokens, shapes["swiglu"].width) == (256, config.ffn_dim // 2)
    assert (shapes["rope"].heads, shapes["rope"].kv_heads, shapes["rope"].width) == (4, 2, config.dim // 8)
