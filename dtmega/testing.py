"""Comparing a parallel model with its unsharded reference: the check every dtmega plan,
kernel and precision is held to, for passes and plans of your own.

    reference = Llama(config) built and initialized with `init_weights(seed=s)` (or a deep copy
    of a model made eagerly, taken before `parallelize`), and
    pm = dtmega.parallelize(<the same model on the meta device>, mesh, plan); pm.init_weights(seed=s)
    assert_close_to_reference(compare_training(reference, pm))

`compare_training` trains both on the same fresh random batches with AdamW and returns the worst
relative errors of the loss, every gradient and every parameter; the tolerances are fp32's
(docs/writing-a-pass.md). Collective: every rank of the parallel model's mesh calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.tensor import DTensor

import dtmega
from dtmega.kernels import per_token_cross_entropy
from dtmega.models.moe import moe_layers, update_expert_bias
from dtmega.passes import family_of

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
    own = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]} if family.loss_inputs else {}
    if getattr(model, "mtp", None) is not None:
        model.mtp_stats = {}
    logits = family.logits(model, batch["tokens"], batch.get("position_ids", None), **own)
    losses = per_token_cross_entropy(logits, batch["labels"])
    mask = batch["loss_mask"]
    return (losses * mask).sum() / mask.sum() + (_moe_losses(model) - before) + _mtp_loss(model)


def _mtp_loss(model: nn.Module) -> torch.Tensor:
    """The multi-token-prediction loss a DeepSeek model recorded in its last forward (zero for
    other models): each depth's mean over its kept positions, times the scaling factor / depths."""
    if getattr(model, "mtp", None) is None or not model.mtp_stats:
        return torch.zeros(())
    depths = len(model.mtp)
    factor = model.config.mtp_loss_scaling_factor / depths
    return sum(factor * model.mtp_stats[f"sum{d}"] / model.mtp_stats[f"count{d}"] for d in range(1, depths + 1))


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
    capture: str | None = None,
) -> Comparison:
    """Trains both models `steps` AdamW steps on the same fresh random batches and returns the
    worst relative errors: loss at every step, every gradient at the first step (where both
    models hold identical weights), every parameter after every step.

    Adam normalizes each gradient entry, so fp32 roundoff in entries near zero would become
    full-size updates; `eps` (1e-5) sits above that roundoff so the trajectory comparison
    measures the plan, not Adam's conditioning.

    `capture` (a torch.compile backend) trains the parallel model with `dtmega.capture_step`
    instead: forward, backward, the optimizer step and the after-step hooks as one compiled
    program; the gradients are read after that step (AdamW leaves them as they were).

    Collective: every rank of the parallel model's mesh must call it.
    """
    vocab = family_of(reference).describe(reference).vocab_size
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=eps, weight_decay=0.1)
    par_opt = torch.optim.AdamW(parallel.parameters(), lr=torch.tensor(lr) if capture else lr, eps=eps,
                                weight_decay=0.1)
    captured = dtmega.capture_step(parallel, par_opt, backend=capture, microbatches=microbatches) if capture else None
    result = Comparison()
    # tied names too: a pipeline's last stage holds the tied output layer under its own name
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for step in range(steps):
        batch = dtmega.synthetic_batch(batch_size, seq_len, vocab, seed=seed + 1000 * step, masked_fraction=0.25)
        ref_opt.zero_grad()
        ref_loss = reference_loss(reference, batch)
        ref_loss.backward()
        if captured is not None:
            par_loss = captured(parallel.shard_batch(batch))
        else:
            par_opt.zero_grad()
            par_loss = parallel.forward_backward(parallel.shard_batch(batch), microbatches=microbatches)
        result.loss = max(result.loss, relative_error(par_loss, ref_loss))
        for name, param in parallel.named_parameters():
            assert param.grad is not None, f"{name} got no gradient"
            if step == 0 or evaluate_between_steps:  # gathered only where compared: a gather per parameter
                error = relative_error(full(param.grad), ref_params[name].grad)
                result.grads[name] = max(result.grads.get(name, 0.0), error)
                if error > result.grad:
                    result.grad, result.worst_grad_name = error, name
        assert_covers_parameters(parallel, set(dict(reference.named_parameters())), set(ref_params))
        ref_opt.step()
        if captured is None:
            par_opt.step()
            parallel.after_optimizer_step()
        update_expert_bias(reference)
        for name, error in parameter_errors(parallel, ref_params).items():
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


def parameter_errors(parallel: dtmega.ParallelModel, ref_params: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's relative error against the reference's, computed shard by shard: every
    rank compares its local shard with the same slice of the reference (`distribute_tensor` with
    `src_data_rank=None` slices locally, no communication), and one all-reduce per mesh axis sums
    the squared errors and norms. Equal to `relative_error(full(param), reference)` up to fp64
    summation order, without a gather per parameter (a test's step compared ~40 gathers);
    replicated copies each count once per replica, the same for every shard, so the ratio is
    unchanged and a diverging replica still shows. Collective over the parallel model's mesh."""
    from torch.distributed.tensor import distribute_tensor

    names = sorted(ref_params)
    index = {name: i for i, name in enumerate(names)}
    sums = torch.zeros(len(names), 2, dtype=torch.float64)  # [squared error, squared reference norm]
    held = []
    for name, param in parallel.named_parameters():
        held.append(name)
        expected = ref_params[name].detach()
        actual = param.detach()
        if isinstance(actual, DTensor):
            expected = distribute_tensor(expected, actual.device_mesh, actual.placements, src_data_rank=None).to_local()
            actual = actual.to_local()
        actual, expected = actual.double().cpu(), expected.double().cpu()
        sums[index[name], 0] += (actual - expected).pow(2).sum()
        sums[index[name], 1] += expected.pow(2).sum()
    mesh = parallel.mesh
    if mesh is not None and dist.is_initialized():
        for axis in range(mesh.ndim):
            if mesh.size(axis) > 1:
                dist.all_reduce(sums, group=mesh.get_group(axis))
    errors = {}
    for name in held:
        diff, scale = sums[index[name]].sqrt().tolist()
        errors[name] = diff / scale if scale > 0 else diff
    return errors


def assert_covers_parameters(parallel: dtmega.ParallelModel, expected: set[str], names: set[str] | None = None) -> None:
    """Every parameter of the unsharded model lives on some rank (pipeline stages split them);
    `names`: every name a parameter may go by (a tied weight's second name, which a pipeline's
    last stage holds its copy under), default `expected`."""
    local = set(dict(parallel.named_parameters()))
    names = expected if names is None else names
    assert local <= names, f"unknown parameters {sorted(local - names)[:5]}"
    if parallel.pipelined:
        everyone: list = [None] * dist.get_world_size(parallel.pipeline_group())
        dist.all_gather_object(everyone, sorted(local), group=parallel.pipeline_group())
        local = set().union(*map(set, everyone))
    assert expected <= local, f"parameters missing from every rank: {sorted(expected - local)[:5]}"


def assert_close_to_reference(result: Comparison) -> None:
    """The suite's stated tolerances."""
    assert result.loss <= LOSS_RTOL, f"loss relative error {result.loss:.2e} > {LOSS_RTOL}"
    assert result.grad <= GRAD_RTOL, f"gradient {result.worst_grad_name} relative error {result.grad:.2e} > {GRAD_RTOL}"
    assert result.param <= PARAM_RTOL, f"parameter relative error {result.param:.2e} > {PARAM_RTOL}"
