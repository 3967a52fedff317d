"""Tensor- and sequence-parallel styles: how one module is annotated, and the torch
`ParallelStyle` that materializes the annotation.

Layout strings are the contract between the halves: `inputs`/`outputs` hold "src->dst" when a
redistribution happens at the module boundary (e.g. "P->S(1)" is a reduce-scatter) and a lone
placement when the activation passes through as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from dtmega.passes.errors import PlanError
from dtmega.passes.layout import ModuleLayout
from dtmega.passes.placements import PARTIAL, REPLICATE, shard, to_placement, transition

SEQ = shard(1)
LAST = shard(-1)


@dataclass(frozen=True)
class Style:
    """A named way to shard one module over one mesh axis: `annotate(entry, module, axis, size,
    options)` writes the layout entry (pure), `build(entry, axis)` returns the torch
    `ParallelStyle` that materializes exactly what the entry says. `owner` is the capability
    of the passes that apply it ("tensor_parallel", "sequence_parallel")."""

    name: str
    owner: str
    annotate: Callable[[ModuleLayout, nn.Module, str, int, dict[str, Any]], None]
    build: Callable[[ModuleLayout, str], ParallelStyle] | None  # None: nothing to materialize
    # Whether the module's output is sharded over the axis for what its parent does next (a
    # column-wise linear's heads, a sequence-sharded norm's positions): every parameter under
    # its parent must then be covered by a style (passes/accounting.py).
    opens_region: bool = False


def _require_divisible(what: str, size: int, axis: str, tp: int, fqn_hint: str) -> None:
    if size % tp:
        raise PlanError(
            f"{fqn_hint}: {what}={size} is not divisible by {axis}={tp}. "
            f"Fix: use a {axis} size that divides {size}, or exclude the module with Rule(..., 'none')"
        )


def _linear(module: nn.Module, style: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise PlanError(f"style {style!r} shards an nn.Linear, but got {type(module).__name__}")
    return module


def _set_params(entry: ModuleLayout, axis: str, placements: dict[str, str]) -> None:
    for name, param in entry.params.items():
        param.placements[axis] = placements.get(name, REPLICATE)


# ---- annotate halves --------------------------------------------------------------------------
def _annotate_colwise(entry, module, axis, size, options):
    _require_divisible("out_features", _linear(module, "colwise").out_features, axis, size, entry.type)
    _set_params(entry, axis, {"weight": shard(0), "bias": shard(0)})
    entry.inputs[axis], entry.outputs[axis] = REPLICATE, LAST


def _annotate_rowwise(entry, module, axis, size, options):
    _require_divisible("in_features", _linear(module, "rowwise").in_features, axis, size, entry.type)
    _set_params(entry, axis, {"weight": shard(1), "bias": REPLICATE})
    entry.inputs[axis], entry.outputs[axis] = LAST, f"{PARTIAL}->{REPLICATE}"


def _annotate_embedding(entry, module, axis, size, options):
    if not isinstance(module, nn.Embedding):
        raise PlanError(f"style 'embedding' shards an nn.Embedding, but got {type(module).__name__}")
    _require_divisible("num_embeddings (vocab)", module.num_embeddings, axis, size, entry.type)
    _set_params(entry, axis, {"weight": shard(0)})
    entry.inputs[axis], entry.outputs[axis] = REPLICATE, f"{PARTIAL}->{REPLICATE}"
    # {"residual": False}: the lookup feeds a module of the model's own (the GPT family's word +
    # position embedding), which the residual stream leaves; SequenceParallel then splits that
    # module's output, not this one's
    entry.options = {**entry.options, **options}


def _annotate_output(entry, module, axis, size, options):
    _require_divisible("out_features (vocab)", _linear(module, "output").out_features, axis, size, entry.type)
    _set_params(entry, axis, {"weight": shard(0), "bias": shard(0)})
    entry.inputs[axis], entry.outputs[axis] = REPLICATE, LAST


def _annotate_sequence_norm(entry, module, axis, size, options):
    _set_params(entry, axis, {})
    entry.inputs[axis], entry.outputs[axis] = SEQ, SEQ


def _annotate_gather_input(entry, module, axis, size, options):
    if ("args" in options) == ("kwarg" in options):
        raise PlanError("style 'gather_input' needs exactly one of options {'args': N} or {'kwarg': name}")
    entry.inputs[axis] = f"{SEQ}->{REPLICATE}"
    entry.options = {**entry.options, **options}


def _annotate_scatter_output(entry, module, axis, size, options):
    entry.outputs[axis] = f"{REPLICATE}->{SEQ}"


def _annotate_replicate(entry, module, axis, size, options):
    # the module's parameters whole on every rank, its activations whole too: said explicitly
    # (a rule, not an omission) for a module inside a sharded region
    _set_params(entry, axis, {})


def _annotate_head_norm(entry, module, axis, size, options):
    # a per-head norm (Qwen3's q/k norm) on head-sharded activations [B, S, H, D]: its weight
    # whole on every rank, its gradient summed over the ranks' heads
    _set_params(entry, axis, {})
    dim = shard(int(options.get("dim", 2)))
    entry.inputs[axis], entry.outputs[axis] = dim, dim
    entry.options = {**entry.options, "dim": int(options.get("dim", 2))}


def _annotate_moe(entry, module, axis, size, options):
    # Routing sees every token of the micro-batch on every TP rank; the experts' outputs are
    # reduced inside (expert_hidden), so the layer's output is whole on every rank.
    entry.inputs[axis], entry.outputs[axis] = REPLICATE, REPLICATE


# Expert weights [E, hidden, dim] (w1, w3) and [E, dim, hidden] (w2): shard the hidden dim.
EXPERT_HIDDEN_DIMS = {"w1": 1, "w3": 1, "w2": 2}


def expert_hidden_dims(module: nn.Module) -> dict[str, int]:
    """EXPERT_HIDDEN_DIMS of the weights `module` has (GeLU experts have no w3)."""
    return {name: dim for name, dim in EXPERT_HIDDEN_DIMS.items() if getattr(module, name, None) is not None}


def _annotate_expert_hidden(entry, module, axis, size, options):
    hidden = getattr(module, "w1").shape[1]
    _require_divisible("expert hidden size (moe ffn_dim)", hidden, axis, size, entry.type)
    _set_params(entry, axis, {name: shard(dim) for name, dim in expert_hidden_dims(module).items()})
    entry.outputs[axis] = f"{PARTIAL}->{REPLICATE}"


# ---- build halves -----------------------------------------------------------------------------
def _src(text: str):
    return to_placement(transition(text)[0])


def _dst(text: str):
    return to_placement(transition(text)[1])


def _build_colwise(entry, axis):
    return ColwiseParallel(input_layouts=_src(entry.inputs[axis]), output_layouts=Shard(-1), use_local_output=True)


def _build_rowwise(entry, axis):
    out = _dst(entry.outputs[axis])
    return RowwiseParallel(input_layouts=Shard(-1), output_layouts=out, use_local_output=out == Replicate())


def _build_embedding(entry, axis):
    out = _dst(entry.outputs[axis])
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=out, use_local_output=out == Replicate())


def _build_output(entry, axis):
    # Logits stay a vocab-sharded DTensor: the loss is computed without gathering them.
    return ColwiseParallel(input_layouts=_src(entry.inputs[axis]), output_layouts=Shard(-1), use_local_output=False)


def _build_sequence_norm(entry, axis):
    return SequenceParallel(sequence_dim=1)


def _build_head_norm(entry, axis):
    # torch's SequenceParallel style on the heads dim: the input is this rank's heads, the weight
    # a replicated DTensor whose gradient autograd sums over the axis, the output local again
    return SequenceParallel(sequence_dim=int(entry.options.get("dim", 2)), use_local_output=True)


def _build_gather_input(entry, axis):
    # "R->S(1)" on the output: nothing inside reduce-scatters back to the residual stream (a
    # module no tensor-parallel style shards), so its whole-sequence output is split here.
    scatter = entry.outputs.get(axis) == f"{REPLICATE}->{SEQ}"
    if "kwarg" in entry.options:
        name = entry.options["kwarg"]
        inputs = dict(input_kwarg_layouts={name: Shard(1)}, desired_input_kwarg_layouts={name: Replicate()})
    else:
        rest = (None,) * (int(entry.options["args"]) - 1)
        inputs = dict(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
    if not scatter:
        return PrepareModuleInput(**inputs, use_local_output=True)
    return PrepareModuleInputOutput(**inputs, use_local_input=True, output_layouts=(Replicate(),),
                                    desired_output_layouts=(Shard(1),), use_local_output=False)


def _build_scatter_output(entry, axis):
    return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False)


def _build_moe(entry, axis):
    src, dst = _src(entry.inputs[axis]), _dst(entry.outputs[axis])
    return PrepareModuleInputOutput(
        input_layouts=(src,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(dst,), use_local_output=dst == Replicate(),
    )


class ExpertHiddenParallel(ParallelStyle):
    """Shards every expert's hidden dim (Megatron's expert tensor parallelism) and has the
    experts module sum its partial outputs over the axis. Where expert parallelism also shards
    the experts, it distributes the weights over both axes itself (`options['expert_parallel']`)."""

    def __init__(self, distribute: bool):
        super().__init__()
        self.distribute = distribute

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.distribute:
            for name, dim in expert_hidden_dims(module).items():
                param = getattr(module, name)
                sharded = distribute_tensor(param.data, device_mesh, [Shard(dim)], src_data_rank=None)
                setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.tp_mesh = device_mesh
        return module


def _build_expert_hidden(entry, axis):
    return ExpertHiddenParallel(distribute=not entry.options.get("expert_parallel", False))


class TorchtitanVocabEmbedding(ParallelStyle):
    """torchtitan's `Embedding` does its own vocab-parallel lookup once it is given a TP group
    (and always reads the local shard of a DTensor weight): shard the weight, hand it the group,
    and turn its partial output into the layout's output placement."""

    def __init__(self, output_layout):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight = distribute_tensor(module.weight.data, device_mesh, [Shard(0)], src_data_rank=None)
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        module.tp_group = device_mesh.get_group()
        layout = self.output_layout

        def reduce_output(mod, inputs, output):
            partial = DTensor.from_local(output, device_mesh, [Partial()], run_check=False)
            result = partial.redistribute(placements=[layout])
            return result.to_local() if layout == Replicate() else result

        module.register_forward_hook(reduce_output)
        return module


def _build_torchtitan_embedding(entry, axis):
    return TorchtitanVocabEmbedding(_dst(entry.outputs[axis]))


STYLES: dict[str, Style] = {
    s.name: s
    for s in (
        Style("colwise", "tensor_parallel", _annotate_colwise, _build_colwise, opens_region=True),
        Style("replicate", "tensor_parallel", _annotate_replicate, None),
        Style("head_norm", "tensor_parallel", _annotate_head_norm, _build_head_norm),
        Style("rowwise", "tensor_parallel", _annotate_rowwise, _build_rowwise),
        Style("embedding", "tensor_parallel", _annotate_embedding, _build_embedding),
        Style("torchtitan_embedding", "tensor_parallel", _annotate_embedding, _build_torchtitan_embedding),
        Style("output", "tensor_parallel", _annotate_output, _build_output),
        Style("sequence_norm", "sequence_parallel", _annotate_sequence_norm, _build_sequence_norm, opens_region=True),
        Style("gather_input", "sequence_parallel", _annotate_gather_input, _build_gather_input),
        Style("scatter_output", "sequence_parallel", _annotate_scatter_output, _build_scatter_output),
        Style("moe", "tensor_parallel", _annotate_moe, _build_moe),
        Style("expert_hidden", "tensor_parallel", _annotate_expert_hidden, _build_expert_hidden),
    )
}

# Styles whose output joins the residual stream (sequence parallelism reduce-scatters it)
# and whose input leaves it (sequence parallelism all-gathers it).
RESIDUAL_WRITERS = ("rowwise", "embedding", "torchtitan_embedding")
RESIDUAL_READERS = ("output",)
# Styles that both leave and join the residual stream (their output is whole on every rank).
RESIDUAL_BLOCKS = ("moe",)


# (style name, kernel name) -> build: the ParallelStyle for an entry whose kernel is that one
# (e.g. a column-wise linear that runs in FP8 casts its input before the all-gather).
VARIANTS: dict[tuple[str, str], Callable[[ModuleLayout, str], ParallelStyle]] = {}


def register_style(new: Style, *, replace: bool = False) -> Style:
    """Makes a style usable in rules (`Rule("layers.*.mlp.up", "my_style")`) and layouts."""
    if new.name in STYLES and not replace and STYLES[new.name] != new:
        raise PlanError(f"a style named {new.name!r} is registered already; pass replace=True to replace it")
    STYLES[new.name] = new
    return new


def register_style_variant(style_name: str, kernel: str, build: Callable[[ModuleLayout, str], ParallelStyle]) -> None:
    """Builds entries of style `style_name` whose layout kernel is `kernel` with `build` instead
    of the style's own (a kernel that changes how the module shards: FP8 linears, fused norms)."""
    if style_name not in STYLES:
        raise PlanError(f"unknown style {style_name!r}; known styles: {', '.join(sorted(STYLES))}")
    VARIANTS[(style_name, kernel)] = build


def style(name: str, owner: str) -> Style:
    """The style called `name`, checked to belong to pass `owner`."""
    if name not in STYLES:
        raise PlanError(f"unknown style {name!r}; known styles: {', '.join(sorted(STYLES))}, or 'none'")
    found = STYLES[name]
    if found.owner != owner:
        raise PlanError(f"style {name!r} belongs to {found.owner}, not {owner}; give it in that pass's rules")
    return found


def build_style(entry: ModuleLayout, axis: str) -> ParallelStyle:
    """The ParallelStyle that materializes `entry` on `axis`: its kernel's variant if one is
    registered, else the style's own."""
    variant = VARIANTS.get((entry.style, entry.kernel)) if entry.kernel else None
    build = variant or STYLES[entry.style].build
    if build is None:
        raise PlanError(f"style {entry.style!r} materializes nothing; no ParallelStyle builds it")
    return build(entry, axis)


def apply_styles(program, owner: str, axis: str) -> int:
    """Materializes every layout entry whose style `owner` owns, on mesh axis `axis` (what
    TensorParallel and SequenceParallel apply, and the route for a pass of one's own)."""
    mesh = program.submesh(axis)
    count = 0
    for fqn, entry in program.layout.modules.items():
        if entry.style is None or entry.style not in STYLES or STYLES[entry.style].owner != owner:
            continue
        if STYLES[entry.style].build is None:
            continue  # nothing to materialize (e.g. "replicate")
        if axis not in entry.inputs and axis not in entry.outputs and not any(
                axis in p.placements for p in entry.params.values()):
            continue  # annotated for another axis
        for module in program.modules_at(fqn):
            parallelize_module(module, mesh, build_style(entry, axis), src_data_rank=None)
            count += 1
    return count


def retie_parameters(program) -> None:
    """Re-points tied parameters at their owner after sharding replaced the owner's Parameter."""
    for full_name, param in program.layout.params():
        if param.tied_to is None:
            continue
        owner_module, _, owner_name = param.tied_to.rpartition(".")
        module_fqn, _, name = full_name.rpartition(".")
        for part in program.parts:
            module, owner = _submodule_or_none(part, module_fqn), _submodule_or_none(part, owner_module)
            if module is None or owner is None:
                continue  # a pipeline stage holding one side: its copy was sharded by its own style
            setattr(module, name, getattr(owner, owner_name))


def _submodule_or_none(part, fqn: str):
    try:
        return part.get_submodule(fqn)
    except AttributeError:
        return None


__all__ = [
    "STYLES", "Style", "style", "apply_styles", "build_style", "register_style", "register_style_variant",
    "retie_parameters", "RESIDUAL_WRITERS", "RESIDUAL_READERS", "RESIDUAL_BLOCKS",
]
