"""One source for the loss and the batch: a loss registered from outside the package, reading a
per-token field of its own, is the loss of every plan. The pipeline used to pick its loss by
itself (a registered loss silently ignored under PP, FusedLoss.chunk_size and autocast too);
now it calls the plan's criterion with the micro-batch's fields, which travel packed to the last
stage, and context parallelism cuts the field with the tokens. Each plan's loss and every
gradient equal the unsharded model's weighted loss (fp32 tolerances of tests/helpers.py), and
two AdamW steps keep them equal."""

from __future__ import annotations

import pytest
import torch

import dtmega
from dtmega.kernels import per_token_cross_entropy
from dtmega.passes import ContextParallel, DataParallel, PipelineSplit, SequenceParallel, TensorParallel
from tests.helpers import (
    GRAD_RTOL,
    LOSS_RTOL,
    PARAM_RTOL,
    build_dtmega_llama,
    debug_llama,
    first_copy_mesh,
    full,
    relative_error,
)
from tests.user_passes import TokenWeightedLoss

PLANS = {
    "one_rank": (dict(), [TokenWeightedLoss()]),
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel(), TokenWeightedLoss()]),
    "cp2": (dict(cp=2), [ContextParallel(), TokenWeightedLoss(), DataParallel("fsdp")]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), TokenWeightedLoss(), DataParallel("ddp")]),
    "pp2_tp2": (dict(pp=2, tp=2), [TensorParallel(), PipelineSplit(microbatches=2), TokenWeightedLoss(),
                                   DataParallel("ddp")]),
    "fsdp2": (dict(dp_shard=2), [TokenWeightedLoss(), DataParallel("fsdp")]),
}


def weighted_batch(step: int, vocab: int):
    batch = dtmega.synthetic_batch(4, 16, vocab, seed=40 + step, masked_fraction=0.25)
    weights = torch.rand(4, 16, generator=torch.Generator().manual_seed(50 + step)) * 3
    return dtmega.make_batch(batch["tokens"], batch["labels"], batch["loss_mask"], token_weight=weights)


@pytest.mark.parametrize("name", list(PLANS))
def test_a_registered_loss_and_its_batch_field_are_used_under_every_plan(name):
    sizes, passes = PLANS[name]
    config = debug_llama(tie_embeddings=False) if "pp" in sizes else debug_llama()
    reference, meta_copy = build_dtmega_llama(config, seed=27)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=27)
    assert pm.batch_fields == ("token_weight",)
    params = dict(reference.named_parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-5)
    par_opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-5)
    for step in range(3):
        batch = weighted_batch(step, config.vocab_size)
        ref_opt.zero_grad()
        losses = per_token_cross_entropy(reference(batch["tokens"]), batch["labels"])
        expected = (losses * batch["loss_mask"] * batch["token_weight"]).sum() / batch["loss_mask"].sum()
        expected.backward()
        par_opt.zero_grad()
        loss = pm.forward_backward(pm.shard_batch(batch))
        assert relative_error(loss, expected) <= LOSS_RTOL, (step, float(loss), float(expected))
        if step == 0:
            for param_name, param in pm.named_parameters():
                error = relative_error(full(param.grad), params[param_name].grad)
                assert error <= GRAD_RTOL, (param_name, error)
        ref_opt.step()
        par_opt.step()
    for param_name, param in pm.named_parameters():
        assert relative_error(full(param), params[param_name]) <= PARAM_RTOL, param_name


def test_a_batch_without_the_field_the_loss_reads_is_refused_naming_it():
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=28)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(), dtmega.Plan([TokenWeightedLoss()]))
    with pytest.raises(KeyError, match=r"batch lacks \['token_weight'\].*make_batch\(tokens, labels, ..., token_weight="):
        pm.forward_backward(dtmega.synthetic_batch(2, 8, 256))
    plain = dtmega.parallelize(meta_copy(), first_copy_mesh(), dtmega.Plan([]))
    with pytest.raises(KeyError, match=r"batch field\(s\) \['token_weight'\] are read by no pass or loss"):
        plain.forward_backward(weighted_batch(0, 256))
