"""FP8 training as a pass: `Float8(recipe="delayed", format="hybrid")` runs the model's linears
in FP8 (Megatron's `--fp8-*` flags; docs/fp8.md).

`annotate` marks which linears run in FP8 and says in the layout (`precision`) why each other
one does not: the output layer (never by default), the first/last N blocks on request
(Megatron's `--first-last-layers-bf16`), dimensions FP8 GEMMs do not take (not multiples of 16),
and projections too small for FP8 to win: measured at the run's per-rank shapes on a GPU
(passes/float8_timing.py, `measure`), else fewer than `min_features` in or out (torchao's
auto-filter idea). It refuses a device without FP8 tensor cores (CPU is the test path), MXFP8
off Blackwell, and a backend that is not installed, naming the install command.

Backends: "dtmega" (dtmega.kernels.float8_linear on `torch._scaled_mm`: delayed, tensorwise
and rowwise scaling; composes with TP/SP, FSDP, CP, PP, EP, recompute; `param_gather`: FSDP2
gathers the weights in FP8, dtmega.kernels.float8_gather); "torchao" (`Float8Linear`,
tensorwise/rowwise, with torchao's FP8 all-gather under FSDP); "transformer_engine" (its
`Linear` and `fp8_autocast` recipes; passes/float8_te.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dtmega.kernels.float8 import AMAX_ALGOS, FORMATS, Float8Recipe
from dtmega.kernels.float8_gather import Float8GatherScale, gather_weight_in_fp8
from dtmega.kernels.float8_linear import Float8State, float8_linear, reduce_and_update_scales
from dtmega.kernels.registry import KernelSpec, register_kernel
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.float8_groups import amax_group
from dtmega.passes.float8_timing import CANDIDATES, LinearShape, device_linear_timer, linear_shape
from dtmega.passes.precision import Precision
from dtmega.passes.program import Program
from dtmega.passes.results import DataParallelism, PassResult
from dtmega.passes.runtime import RuntimeHook

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
BACKENDS = {"dtmega": None, "torchao": "torchao", "transformer_engine": "transformer_engine"}
INSTALL = {"torchao": "pip install torchao", "transformer_engine": "pip install 'dtmega[te]' (needs CUDA)"}

for _backend in BACKENDS:
    register_kernel(KernelSpec(f"linear.float8.{_backend}", "linear", f"FP8 linear ({_backend})",
                               reference=None, packages=(BACKENDS[_backend],) if BACKENDS[_backend] else ()),
                    replace=True)


@dataclass(frozen=True)
class Float8Choice(PassResult):
    """What runs in FP8: the recipe and the linears."""

    recipe: str
    format: str
    backend: str
    modules: tuple[str, ...]
    param_gather: bool = False  # FSDP all-gathers the weights in FP8


@dataclass
class Float8(Pass):
    """Runs the model's linears in FP8 (see the module docstring)."""

    recipe: str = "delayed"
    format: str = "hybrid"
    backend: str = "dtmega"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    param_gather: bool = False  # FSDP all-gathers the weights in FP8 (delayed/tensorwise; dtmega or torchao)
    first_blocks_bf16: int = 0
    last_blocks_bf16: int = 0
    include_output: bool = False
    min_features: int = 1024
    device: str | None = None  # the device the plan will run on (default: the mesh's)
    # Each eligible projection's precision by measuring FP8 against bf16 at its per-rank shape
    # (passes/float8_timing.py) instead of `min_features`: None = where it can be (a GPU, a
    # workload, the dtmega backend), True = insist, False = never. `timer(shape, candidate)`
    # replaces the device (tests: a fake timer); `cache` is the file of measured choices.
    measure: bool | None = None
    timer: Callable[[LinearShape, str], float] | None = None
    cache: str | None = None

    provides = ("float8",)
    after = ("tensor_parallel@*", "sequence_parallel@*", "expert_parallel@*", "fused_kernels")

    def _device(self, program: Program) -> str:
        if self.device is not None:
            return self.device
        if program.mesh is not None:
            return program.mesh.device_type
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _check(self, program: Program) -> None:
        if self.recipe not in RECIPES:
            raise PlanError(f"Float8(recipe={self.recipe!r}) is unknown; use one of {RECIPES}")
        if self.format not in FORMATS:
            raise PlanError(f"Float8(format={self.format!r}) is unknown; use one of {FORMATS}")
        if self.backend not in BACKENDS:
            raise PlanError(f"Float8(backend={self.backend!r}) is unknown; use one of {tuple(BACKENDS)}")
        if self.amax_compute_algo not in AMAX_ALGOS or self.amax_history_len < 1:
            raise PlanError(f"Float8: amax_compute_algo in {AMAX_ALGOS} and amax_history_len >= 1, got "
                            f"{self.amax_compute_algo!r} and {self.amax_history_len}")
        package = BACKENDS[self.backend]
        if package is not None and importlib.util.find_spec(package) is None:
            raise PlanError(f"Float8(backend={self.backend!r}) needs {package}, which is not installed. Fix: "
                            f"{INSTALL[self.backend]}, or backend='dtmega'")
        device = self._device(program)
        if device == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability()
            if capability < (8, 9):
                raise PlanError(f"FP8 needs FP8 tensor cores (compute capability 8.9+: L4, L40, H100, H200, B200); "
                                f"this GPU is {capability[0]}.{capability[1]}. Fix: train in bf16")
            if self.recipe == "mxfp8" and capability < (10, 0):
                raise PlanError("MXFP8 (block-scaled FP8) needs a Blackwell GPU (compute capability 10.0+). Fix: "
                                "--fp8-recipe delayed or tensorwise on this GPU")
        if self.recipe in ("blockwise", "mxfp8") and self.backend != "transformer_engine":
            raise PlanError(f"the {self.recipe} recipe runs on Transformer Engine only. Fix: "
                            f"backend='transformer_engine' (--transformer-impl transformer_engine), or recipe "
                            "'delayed', 'tensorwise' or 'rowwise'")
        if self.backend == "torchao" and self.recipe == "delayed":
            raise PlanError("torchao no longer offers delayed scaling. Fix: backend='dtmega' (its own FP8 linear "
                            "covers it), or recipe 'tensorwise'/'rowwise' with torchao (--fp8-recipe tensorwise)")
        torchao_format = {"tensorwise": "hybrid", "rowwise": "e4m3"}.get(self.recipe)
        if self.backend == "torchao" and torchao_format and self.format != torchao_format:
            raise PlanError(f"torchao's {self.recipe} recipe is {torchao_format} (tensorwise: e4m3 forward, e5m2 "
                            f"gradients; rowwise: e4m3 everywhere), not {self.format}. Fix: format="
                            f"'{torchao_format}' (--fp8-format {torchao_format}), or backend='dtmega'")
        gather_recipes = {"dtmega": ("delayed", "tensorwise"), "torchao": ("tensorwise",)}.get(self.backend, ())
        if self.param_gather and self.recipe not in gather_recipes:
            supported = " and ".join(gather_recipes) or "no recipe"
            raise PlanError(f"FP8 all-gather (param_gather, --fp8-param-gather) casts weight shards with one scale per "
                            f"tensor: backend {self.backend!r} does it for {supported}, not {self.recipe}. Fix: recipe "
                            "'delayed' or 'tensorwise' with backend='dtmega' (--fp8-recipe delayed), or drop "
                            "param_gather")
        if self.backend == "torchao" and program.role_size("tensor") > 1:
            raise PlanError("Float8(backend='torchao') is not wired to tensor parallelism here. Fix: backend='dtmega'")

    def annotate(self, program: Program) -> None:
        self._check(program)
        facts = program.facts
        blocks = list(facts.blocks)
        bf16_blocks = set(blocks[:self.first_blocks_bf16]) | set(blocks[len(blocks) - self.last_blocks_bf16:])
        measuring = self._measurement(program)
        chosen = []
        for fqn, module in program.modules.items():
            if not isinstance(module, nn.Linear):
                continue
            _check_plain_linear(fqn, module)
            entry = program.layout[fqn]
            block = next((b for b in blocks if fqn.startswith(f"{b}.")), None)
            reason = None
            if fqn == facts.output and not self.include_output:
                reason = "the output layer stays bf16 (include_output=True to change)"
            elif block is None and fqn != facts.output:
                reason = "outside the transformer blocks"
            elif block in bf16_blocks:
                reason = "first/last blocks kept in bf16"
            elif module.in_features % 16 or module.out_features % 16:
                reason = f"FP8 GEMMs need dimensions divisible by 16 ({module.in_features}x{module.out_features})"
            elif measuring:
                reason = self._measured_reason(program, fqn, module, measuring)
            elif min(module.in_features, module.out_features) < self.min_features:
                reason = (f"too small for FP8 to win ({module.in_features}x{module.out_features} < "
                          f"{self.min_features}; min_features)")
            if reason:
                entry.precision = Precision(reason=reason)
                continue
            entry.precision = Precision(fp8_recipe=self.recipe, fp8_format=self.format)
            entry.kernel = f"linear.float8.{self.backend}"
            chosen.append(fqn)
        program.record(Float8Choice(self.recipe, self.format, self.backend, tuple(chosen), self.param_gather))
        how = "measured per shape" if measuring else f"min_features {self.min_features}"
        program.note(f"Float8({self.recipe}, {self.format}, {self.backend}): {len(chosen)} linears in FP8 ({how})")

    def _measurement(self, program: Program) -> dict | None:
        """How this plan measures the projections' precision ({"timer", "chooser", "device"}),
        or None where `min_features` decides (with a note why)."""
        from dtmega.kernels.measured_choice import MeasuredChoice

        if self.measure is False:
            return None
        device = self._device(program)
        can_measure = device == "cuda" and torch.cuda.is_available()
        why = None
        if self.backend != "dtmega":
            why = f"the {self.backend} backend's kernels are not measured here"
        elif program.workload is None:
            why = "no workload gives the shapes"
        elif self.timer is None and not can_measure:
            why = f"nothing to measure on ({device})"
        if why is not None:
            if self.measure:
                raise PlanError(f"Float8(measure=True): {why}. Fix: run on the GPU with the run's workload "
                                "(dtmega.parallelize(..., workload=...)), or measure=None to fall back to min_features")
            if self.timer is not None or can_measure:
                program.note(f"Float8: min_features {self.min_features} decides the narrow projections ({why})")
            return None
        name = torch.cuda.get_device_name() if can_measure and self.timer is None else device
        return {"chooser": MeasuredChoice("float8_linear", self.cache, preference=CANDIDATES), "device": name,
                "shapes": {}}

    def _measured_reason(self, program: Program, fqn: str, module: nn.Linear, measuring: dict) -> str | None:
        """Why `fqn` stays bf16 by measurement (None: FP8 was faster)."""
        shape = linear_shape(program, fqn, module, self.recipe, self.format)
        choice = measuring["shapes"].get(shape)
        if choice is None:
            timer = (lambda candidate: self.timer(shape, candidate)) if self.timer is not None else \
                device_linear_timer(shape, torch.device("cuda", torch.cuda.current_device()))
            choice = measuring["chooser"].choose(shape.key(measuring["device"]), CANDIDATES, timer)
            choice = measuring["shapes"][shape] = _rank_zeros(program, choice)
            program.note(f"Float8: {shape.tokens} x {shape.in_features} -> {shape.out_features} per rank: "
                         f"{choice.describe()}")
        if choice.chosen == "fp8":
            return None
        return f"measured: bf16 is as fast or faster at {shape.in_features}->{shape.out_features} ({choice.describe()})"

    def finalize(self, program: Program) -> None:
        data = program.result(DataParallelism)
        if self.param_gather and (data is None or data.mode == "ddp"):
            raise PlanError("FP8 all-gather (param_gather, --fp8-param-gather) gathers FSDP-sharded weights in FP8; "
                            "this plan shards no weights. Fix: DataParallel('fsdp') or 'hsdp' "
                            "(--use-distributed-optimizer), or drop param_gather")

    def apply(self, program: Program) -> None:
        choice = program.require(Float8Choice, "Float8.apply")
        if self.backend == "torchao":
            from dtmega.passes.float8_torchao import apply_torchao

            apply_torchao(program, self, choice)
            return
        if self.backend == "transformer_engine":
            from dtmega.passes.float8_te import apply_transformer_engine

            apply_transformer_engine(program, self, choice)
            return
        recipe = Float8Recipe(self.recipe, self.format, self.amax_history_len, self.amax_compute_algo)
        group = amax_group(program)
        states = {}
        for fqn in choice.modules:
            for module in program.modules_at(fqn):
                state = Float8State(self.amax_history_len, program.mesh.device_type) if self.recipe == "delayed" else None
                if state is not None:
                    states[fqn] = state
                module.counting = True  # off while a pipeline stage infers shapes on stand-in tensors
                module.forward = _fp8_forward(module, recipe, state, group)
                if self.param_gather:
                    gather_weight_in_fp8(module, Float8GatherScale(recipe, state, group, module))
        program.add_hook(Float8Scaling(states, recipe, group))


def _rank_zeros(program: Program, choice):
    """Rank 0's measured choice on every rank: each rank measures, but all must run the same
    linears in FP8 (delayed scaling reduces every FP8 linear's amaxes in one collective, and a
    tensor-parallel linear's shards must agree). Every rank annotates the same linears at the same
    shapes in the same order, so this broadcast pairs up."""
    import torch.distributed as dist

    if program.mesh is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return choice
    chosen = [choice.chosen]
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] != choice.chosen:
        program.note(f"Float8: rank 0 measured {chosen[0]} where this rank measured {choice.chosen}; all take rank 0's")
        choice = type(choice)(chosen[0], choice.seconds, choice.cached)
    return choice


def _check_plain_linear(fqn: str, module: nn.Linear) -> None:
    """PlanError for a Linear whose computation the FP8 GEMM would drop: a subclass with its own
    forward, or with parameters or submodules beyond weight and bias (a LoRA adapter, say)."""
    extra = sorted({name for name, _ in module.named_parameters()} - {"weight", "bias"})
    children = [name for name, _ in module.named_children()]
    if type(module).forward is nn.Linear.forward and not extra and not children:
        return
    what = (f"its class {type(module).__module__}.{type(module).__name__} has a forward of its own"
            if type(module).forward is not nn.Linear.forward else f"it holds {', '.join(extra + children)}")
    raise PlanError(f"Float8 would run {fqn} as an FP8 GEMM on its weight and bias, but {what}: that computation "
                    "would be dropped. Fix: a plain nn.Linear at that site (merge an adapter into its weight first), "
                    "or a plan without Float8")


def _fp8_forward(module: nn.Linear, recipe: Float8Recipe, state, group):
    """The linear's forward in FP8. Delayed scaling's history takes the amaxes of training
    passes only: not evaluation (validation data must not change the training run's scales),
    not a pipeline stage's shape inference on stand-in tensors (`counting` off)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        record = module.training and torch.is_grad_enabled() and module.counting
        return float8_linear(x, module.weight, module.bias, recipe, state, group, record)

    return forward


class Float8Scaling(RuntimeHook):
    """Delayed scaling's step: after the optimizer, every linear's amaxes of the step are
    reduced in one collective, pushed into its history, and the next step's scales computed.
    The histories and scales are checkpointed with the model (`state_dict`)."""

    def __init__(self, states: dict[str, Float8State], recipe: Float8Recipe, group):
        self.states, self.recipe, self.group = states, recipe, group

    def after_optimizer_step(self) -> None:
        reduce_and_update_scales(list(self.states.values()), self.recipe, self.group)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"fp8.{fqn}.{key}": value for fqn, state in self.states.items()
                for key, value in state.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for fqn, own in self.states.items():
            own.load_state_dict({key: state[f"fp8.{fqn}.{key}"] for key in ("amax_history", "scale")})
