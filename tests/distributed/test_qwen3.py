"""Qwen3 (dtmega/models/qwen3/) under every plan against the unsharded Qwen3: loss, every gradient,
5 AdamW steps, at the suite's fp32 tolerances (tests/helpers.py: 1e-5 relative, fp32 sums in
another order). The size is `qwen3-debug`: Qwen3's shape in small (q/k norms, head_dim 32 with
4 heads on a width of 64, so heads x head_dim != width, tied embeddings; untied under pipeline
parallelism, which keeps the output layer on the last stage).

FP8 is held to its documented noise (tests/distributed/test_float8.py): the sharded FP8 run is as
close to the fp32 model as one rank's FP8 run is. Packed documents: the plan's loss equals every
document run alone (tests/distributed/test_document_masking.py).
"""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.models.qwen3 import QWEN3_SIZES, Qwen3
from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    DocumentMasking,
    Float8,
    FuseKernels,
    PipelineSplit,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from dtmega.testing import relative_error
from tests.helpers import assert_close_to_reference, compare_training, first_copy_mesh, full, mesh

PLANS = {
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel()]),
    "cp2_ring": (dict(cp=2), [ContextParallel(method="ring"), DataParallel("ddp")]),
    "cp2_all_gather": (dict(cp=2), [ContextParallel(method="all_gather"), DataParallel("ddp")]),
    "cp2_a2a": (dict(cp=2), [ContextParallel(method="a2a"), DataParallel("ddp")]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DataParallel("ddp")]),
    "fsdp2": (dict(dp_shard=2), [DataParallel("fsdp")]),
    "recompute_full_tp2_sp_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), SequenceParallel(), Recompute("full"),
                                                             DataParallel("fsdp")]),
    "recompute_selective_tp2_ddp2": (dict(tp=2, dp_replicate=2), [TensorParallel(), Recompute("selective"),
                                                                  DataParallel("ddp")]),
    "compiled_fused_tp2_sp_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), SequenceParallel(), FuseKernels(),
                                                             DataParallel("fsdp"), Compile("aot_eager")]),
}


def qwen3_config(untied: bool = False):
    config = QWEN3_SIZES["qwen3-debug"]
    return config.replace(tie_embeddings=False) if untied else config


def build(config, seed: int, model_class=Qwen3):
    """The materialized unsharded reference (random norms), and a factory of meta copies to
    shard (`model_class`: Qwen3, or a family built on it such as Qwen3-MoE)."""
    with torch.device("meta"):
        reference = model_class(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=seed)
    _randomize_norms(reference, seed)

    def meta_copy():
        with torch.device("meta"):
            return model_class(config)

    return reference, meta_copy


def _randomize_norms(model, seed: int) -> None:
    """Norm weights start at one, where a wrong per-head channel order or a missing gradient sum
    changes nothing: the reference and every plan start from the same random ones instead."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)


def _load_norms(pm, reference) -> None:
    """The reference's norm weights into the plan's (sharded or replicated) parameters."""
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in pm.named_parameters():
            if name.endswith("norm.weight"):
                source = params[name].detach()
                if isinstance(param, torch.distributed.tensor.DTensor):
                    source = torch.distributed.tensor.distribute_tensor(source, param.device_mesh, param.placements)
                param.copy_(source)


@pytest.mark.parametrize("name", list(PLANS))
def test_qwen3_plan_matches_unsharded(name):
    sizes, passes = PLANS[name]
    config = qwen3_config(untied="pp" in sizes)
    reference, meta_copy = build(config, seed=51)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=51)
    _load_norms(pm, reference)
    batch = 8 if "pp" in sizes else 4
    assert_close_to_reference(compare_training(reference, pm, steps=5, batch_size=batch, seq_len=32))


def test_qwen3_packed_documents_equal_each_document_alone():
    from tests.distributed.test_document_masking import train_against_each_document_alone

    config = qwen3_config()
    reference, meta_copy = build(config, seed=52)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(tp=2, cp=2),
                            [TensorParallel(), SequenceParallel(), DocumentMasking(), ContextParallel(method="a2a"),
                             DataParallel("fsdp")])
    pm.init_weights(seed=52)
    _load_norms(pm, reference)
    train_against_each_document_alone(pm, reference, lambda tokens: reference(tokens), config.vocab_size, steps=3)


def test_qwen3_fp8_within_fp8_noise_of_one_rank():
    """TP2+SP with FP8 linears (tensorwise): as close to the fp32 model as one rank's FP8 run."""
    from tests.distributed.test_float8 import _run, _worst

    config = qwen3_config()
    fp8 = Float8(recipe="tensorwise", format="hybrid", amax_history_len=4, amax_compute_algo="max", min_features=16)
    _, meta_copy = build(config, seed=53)
    models = (dtmega.parallelize(meta_copy(), mesh(), [DataParallel("fsdp")]),
              dtmega.parallelize(meta_copy(), mesh(), [fp8, DataParallel("fsdp")]),
              dtmega.parallelize(meta_copy(), first_copy_mesh(tp=2), [TensorParallel(), SequenceParallel(), fp8]))
    for model in models:
        model.init_weights(seed=53)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5) for m in models]
    for step in range(3):
        batch = dtmega.synthetic_batch(8, 32, config.vocab_size, seed=110 + step, masked_fraction=0.25)
        loss_ref, grads_ref = _run(models[0], batch, optimizers[0], None)
        loss_one, grads_one = _run(models[1], batch, optimizers[1], None)
        loss_pm, grads_pm = _run(models[2], models[2].shard_batch(batch), optimizers[2])
        noise = {"loss": relative_error(loss_one, loss_ref), "grad": _worst(grads_one, grads_ref)}
        sharded = {"loss": relative_error(loss_pm, loss_ref), "grad": _worst(grads_pm, grads_ref)}
        assert noise["grad"] > 1e-3, f"FP8 left the gradients unchanged ({noise})"
        # the bounds of test_fp8_plans_within_fp8_noise_of_one_rank, with its reasons
        assert sharded["loss"] <= 2 * noise["loss"] + 1e-4, (step, sharded, noise)
        assert sharded["grad"] <= 1.25 * noise["grad"] + 0.01, (step, sharded, noise)


def test_qwen3_q_and_k_norm_gradients_equal_the_unsharded_models_on_every_rank():
    """After one step under TP2+SP, every rank holds the unsharded model's q/k-norm gradients."""
    config = qwen3_config()
    reference, meta_copy = build(config, seed=54)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(tp=2), [TensorParallel(), SequenceParallel()])
    pm.init_weights(seed=54)
    _load_norms(pm, reference)
    batch = dtmega.synthetic_batch(4, 16, config.vocab_size, seed=9, masked_fraction=0.25)
    dtmega.testing.reference_loss(reference, batch).backward()
    pm.forward_backward(pm.shard_batch(batch))
    grads = {name: param.grad for name, param in reference.named_parameters()}
    checked = 0
    for name, param in pm.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            assert relative_error(full(param.grad), grads[name]) < 1e-5, name
            checked += 1
    assert checked == 2 * config.n_layers
