"""Shared test helpers: the unsharded reference, and comparisons against it."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import dtmega
from dtmega.kernels import per_token_cross_entropy
from dtmega.models import Llama, LlamaConfig
from dtmega.models.moe import moe_layers, update_expert_bias
from dtmega.passes import family_of

WORLD = 4  # ranks of the distributed suite

# The tolerances every numerics test states: fp32, relative (Frobenius) error per tensor. Plans
# sum in other orders (TP splits matmul reductions, DP sums gradients over ranks, CP merges
# attention blocks), so results differ by fp32 roundoff (~1e-7 relative, measured < 5e-7 on
# gradients and < 3e-6 on parameters after 5 AdamW steps): 1e-5 leaves room for any CPU's
# kernels and still fails on any real error (a wrong scale, a missing term: >= 1e-3).
# Reduced precision is never held to these (see each bf16 test's own bound and reason).
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
PARAM_RTOL = 1e-5


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| (absolute when expected is zero)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / scale if scale > 0 else diff


def full(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a (possibly DTensor) tensor. Collective for DTensors: call on every rank."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _moe_losses(model: nn.Module) -> float:
    return sum(float(layer.stats["loss"]) for _, layer in moe_layers(model) if "loss" in layer.stats)


def reference_loss(model: nn.Module, batch: TensorDict) -> torch.Tensor:
    """The unsharded model's loss on the whole global batch: token-weighted mean cross entropy,
    plus the balancing losses of MoE layers (whose gradient their layers attach themselves)."""
    family = family_of(model)
    before = _moe_losses(model)
    logits = family.logits(model, batch["tokens"], batch.get("position_ids", None))
    losses = per_token_cross_entropy(logits, batch["labels"])
    mask = batch["loss_mask"]
    return (losses * mask).sum() / mask.sum() + (_moe_losses(model) - before)


def debug_llama(**overrides) -> LlamaConfig:
    """The tiny config the suite uses."""
    return LlamaConfig.from_name("debug", **overrides)


def build_dtmega_llama(config: LlamaConfig, seed: int) -> tuple[nn.Module, Callable[[], nn.Module]]:
    """A materialized reference and a factory of meta-device copies to shard."""
    with torch.device("meta"):
        reference = Llama(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=seed)

    def meta_copy() -> nn.Module:
        with torch.device("meta"):
            return Llama(config)

    return reference, meta_copy


@dataclass
class Comparison:
    """Worst relative errors seen while comparing a plan with the reference."""

    loss: float = 0.0
    grad: float = 0.0
    param: float = 0.0
    worst_grad_name: str = ""
    grads: dict[str, float] = field(default_factory=dict)  # worst error per parameter
    params: dict[str, float] = field(default_factory=dict)


def compare_training(
    reference: nn.Module,
    parallel: dtmega.ParallelModel,
    *,
    steps: int = 5,
    batch_size: int = 4,
    seq_len: int = 16,
    seed: int = 0,
    lr: float = 1e-3,
    eps: float = 1e-5,
    microbatches: int | None = None,
    evaluate_between_steps: bool = False,
) -> Comparison:
    """Trains both models `steps` AdamW steps on the same fresh random batches and returns the
    worst relative errors: loss at every step, every gradient at the first step (where both
    models hold identical weights), every parameter after every step.

    Adam normalizes each gradient entry, so fp32 roundoff in entries near zero would become
    full-size updates; `eps` (1e-5) sits above that roundoff so the trajectory comparison
    measures the plan, not Adam's conditioning.

    Collective: every rank of the parallel model's mesh must call it.
    """
    vocab = family_of(reference).describe(reference).vocab_size
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=eps, weight_decay=0.1)
    par_opt = torch.optim.AdamW(parallel.parameters(), lr=lr, eps=eps, weight_decay=0.1)
    result = Comparison()
    ref_params = dict(reference.named_parameters())
    for step in range(steps):
        batch = dtmega.synthetic_batch(batch_size, seq_len, vocab, seed=seed + 1000 * step, masked_fraction=0.25)
        ref_opt.zero_grad()
        ref_loss = reference_loss(reference, batch)
        ref_loss.backward()
        par_opt.zero_grad()
        par_loss = parallel.forward_backward(parallel.shard_batch(batch), microbatches=microbatches)
        result.loss = max(result.loss, relative_error(par_loss, ref_loss))
        for name, param in parallel.named_parameters():
            assert param.grad is not None, f"{name} got no gradient"
            grad = full(param.grad)
            if step == 0 or evaluate_between_steps:
                error = relative_error(grad, ref_params[name].grad)
                result.grads[name] = max(result.grads.get(name, 0.0), error)
                if error > result.grad:
                    result.grad, result.worst_grad_name = error, name
        assert_covers_parameters(parallel, set(ref_params))
        ref_opt.step()
        par_opt.step()
        update_expert_bias(reference)
        parallel.after_optimizer_step()
        for name, param in parallel.named_parameters():
            error = relative_error(full(param), ref_params[name])
            result.params[name] = max(result.params.get(name, 0.0), error)
            result.param = max(result.param, error)
        if evaluate_between_steps:  # as a trainer validates: after the update, before the next step
            par_opt.zero_grad()
            parallel.eval()
            loss_sum, tokens = parallel.loss_sum(parallel.shard_batch(batch))
            parallel.train()
            with torch.no_grad():
                result.loss = max(result.loss, relative_error(loss_sum / tokens, reference_loss(reference, batch)))
    return result


def assert_covers_parameters(parallel: dtmega.ParallelModel, expected: set[str]) -> None:
    """Every parameter of the unsharded model lives on some rank (pipeline stages split them)."""
    local = set(dict(parallel.named_parameters()))
    assert local <= expected, f"unknown parameters {sorted(local - expected)[:5]}"
    if parallel.pipelined:
        everyone: list = [None] * dist.get_world_size(parallel.pipeline_group())
        dist.all_gather_object(everyone, sorted(local), group=parallel.pipeline_group())
        local = set().union(*map(set, everyone))
    assert local == expected, f"parameters missing from every rank: {sorted(expected - local)[:5]}"


def assert_close_to_reference(result: Comparison) -> None:
    """The suite's stated tolerances."""
    assert result.loss <= LOSS_RTOL, f"loss relative error {result.loss:.2e} > {LOSS_RTOL}"
    assert result.grad <= GRAD_RTOL, f"gradient {result.worst_grad_name} relative error {result.grad:.2e} > {GRAD_RTOL}"
    assert result.param <= PARAM_RTOL, f"parameter relative error {result.param:.2e} > {PARAM_RTOL}"


def mesh_shape(**sizes: int) -> dict[str, int]:
    """A mesh shape for checking plans without a process group: every axis, size 1 unless given."""
    from dtmega.mesh import AXES

    return {axis: sizes.get(axis, 1) for axis in AXES}


_MESHES: dict = {}
_GROUPS: dict = {}


def mesh(**sizes: int):
    """A mesh of the given axis sizes (others 1) for the distributed suite: the 4-rank world is
    split into as many independent copies as fit, so 1- and 2-rank plans run on every rank.

    Every gloo process group keeps three threads whose idle polling slows every later
    collective, and a world of 4 has only a handful of distinct rank sets; so meshes are cached
    and built from one cached process group per rank set (`DeviceMesh.from_group`) instead of
    `split_world`'s fresh groups per axis. The mesh is the same as `split_world`'s."""
    from dtmega.mesh import AXES, resolve_mesh_sizes

    sizes = {axis: size for axis, size in sizes.items() if size != 1}
    sizes.setdefault("dp_shard", 1)
    key = tuple(sorted(sizes.items()))
    if key not in _MESHES:
        ranks = 1
        for size in sizes.values():
            ranks *= size
        axis_sizes = resolve_mesh_sizes(ranks, **{axis: sizes.get(axis, 1) for axis in AXES})
        world = torch.arange(WORLD, dtype=torch.int).view(WORLD // ranks, *axis_sizes.values())
        groups = [_group_along(world, dim) for dim in range(world.dim())]
        root = DeviceMesh.from_group(groups, "cpu", mesh=world, mesh_dim_names=("replica", *AXES))
        _MESHES[key] = root[AXES]
    return _MESHES[key]


def first_copy_mesh(**sizes: int):
    """`mesh(**sizes)` for a test whose plan needs fewer ranks than the world: ranks 0..n-1 (the
    first copy) run it and the other ranks skip it, instead of every copy repeating the same work
    on this machine's two cores. Every rank still calls it (an uncached mesh creates its process
    groups collectively). Only for tests whose collectives all run inside the mesh (the skipping
    ranks wait at the barrier after the test)."""
    built = mesh(**sizes)
    ranks = built.size()
    if dist.get_rank() >= ranks:
        import pytest

        first = "rank 0" if ranks == 1 else f"ranks 0-{ranks - 1}"
        pytest.skip(reason=f"the plan runs on {first}; a copy on this rank would repeat its work")
    return built


def first_ranks_mesh(**sizes: int):
    """A mesh of the given axis sizes on the first ranks of the world only (e.g. tp=3 on ranks
    0-2 of 4: a model whose head count only 3 divides); the other ranks get None and must skip
    the test's collectives. Every rank calls it (process groups are created collectively)."""
    from dtmega.mesh import AXES, resolve_mesh_sizes

    ranks = 1
    for size in sizes.values():
        ranks *= size
    axis_sizes = resolve_mesh_sizes(ranks, **{axis: sizes.get(axis, 1) for axis in AXES})
    grid = torch.arange(ranks, dtype=torch.int).view(*axis_sizes.values())
    groups = [_group_along(grid, dim) for dim in range(grid.dim())]
    if dist.get_rank() >= ranks:
        return None
    return DeviceMesh.from_group(groups, "cpu", mesh=grid, mesh_dim_names=AXES)


def _group_along(world: torch.Tensor, dim: int) -> dist.ProcessGroup:
    """This rank's process group along `dim` of the rank grid; every rank creates the missing
    groups in the same order, so the cache stays identical on all ranks."""
    mine = None
    for ranks in world.movedim(dim, -1).reshape(-1, world.size(dim)).tolist():
        key = tuple(ranks)
        if key not in _GROUPS:
            _GROUPS[key] = dist.group.WORLD if len(key) == WORLD else dist.new_group(list(key))
        if dist.get_rank() in key:
            mine = _GROUPS[key]
    return mine


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy with the same weights (for models built eagerly, e.g. HF and torchtitan)."""
    return copy.deepcopy(module)


# Two plans compute the same logits up to fp32 reduction order (~1e-6 relative): a choice whose
# margin (top-1 minus runner-up logit, or the draw's distance to a boundary of the cumulative
# distribution) is below this may go either way. A real divergence has margins of order 0.1.
NEAR_TIE = 1e-4


def assert_same_choices(a, b) -> None:
    """Two `Generation`s of the same model under different plans chose the same tokens, except
    from a near tie on (where both continuations are right, and they may part)."""
    for step, (x, y) in enumerate(zip(a.ids + [None], b.ids + [None])):
        if x != y:
            margin = min(a.margins[step], b.margins[step])
            assert margin < NEAR_TIE, (
                f"the generations part at token {step} ({x} vs {y}) where the choice had margin {margin:.2e}, "
                f"not a near tie (< {NEAR_TIE})")
            return
