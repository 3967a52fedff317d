"""A Llama subclass with per-head q/k RMSNorm (tests/qk_norm_models.py) under TP2+SP (issue 50):
the norms' weights are replicated over the heads' ranks with their gradient summed over them
(the family's `head_norm` rule), so every rank's gradient equals the unsharded model's, and 5
AdamW steps equal it. On main at 30c0e1e the two ranks' gradients differed by 150 %: each rank's
copy learned from its own heads."""

from __future__ import annotations

import torch

import dtmega
from dtmega.passes import Plan, SequenceParallel, TensorParallel
from dtmega.testing import assert_close_to_reference, compare_training, relative_error
from tests.helpers import debug_llama, first_copy_mesh
from tests.qk_norm_models import qk_llama


def test_qk_norm_gradients_equal_the_unsharded_models_on_every_rank():
    config = debug_llama()
    with torch.device("meta"):
        model = qk_llama(config)
        reference = qk_llama(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=5)
    pm = dtmega.parallelize(model, first_copy_mesh(tp=2), Plan([TensorParallel(), SequenceParallel()]))
    pm.init_weights(seed=5)
    assert pm.layout["layers.0.attention.q_norm"].style == "head_norm"
    batch = dtmega.synthetic_batch(4, 16, config.vocab_size, seed=7, masked_fraction=0.25)
    dtmega.testing.reference_loss(reference, batch).backward()
    pm.forward_backward(pm.shard_batch(batch))
    grads = dict(reference.named_parameters())
    from torch.distributed.tensor import DTensor

    for name, param in pm.named_parameters():
        if "_norm" in name and ".attention." in name:
            # a DTensor replicated over the heads' ranks whose gradient is their sum (Partial until the
            # optimizer or the gradient norm reads it): the same value on every rank, the unsharded one
            assert isinstance(param, DTensor) and isinstance(param.grad, DTensor), name
            assert relative_error(param.grad.full_tensor(), grads[name].grad) < 1e-5, name
    result = compare_training(qk_llama_reference(config), fresh(config), steps=5)
    assert_close_to_reference(result)


def qk_llama_reference(config):
    with torch.device("meta"):
        reference = qk_llama(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=11)
    return reference


def fresh(config):
    with torch.device("meta"):
        model = qk_llama(config)
    pm = dtmega.parallelize(model, first_copy_mesh(tp=2), Plan([TensorParallel(), SequenceParallel()]))
    pm.init_weights(seed=11)
    return pm
