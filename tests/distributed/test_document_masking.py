"""Packed documents under every plan that supports them: a batch of samples packing documents
of unequal lengths (one of a single token, one exactly the sample length) gives, under each plan
with DocumentMasking, the per-token losses and every gradient of running each document alone
through the unsharded model (fp32: the suite's 1e-5 relative tolerances, tests/helpers.py), and
five AdamW steps keep them equal. Context parallelism with each method: all-to-all (each rank
attends the whole sequence for its heads), ring and all-gather (tokens dealt to the ranks by
document work, blocks attended only where they share a document). The reference never sees a
mask: it is the plain model on each document by itself, positions from 0."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtmega
from dtmega.kernels import per_token_cross_entropy
from dtmega.models import LlamaConfig
from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    DocumentMasking,
    ExpertParallel,
    FuseKernels,
    PipelineSplit,
    PlanError,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from dtmega.passes.context_parallel import SequenceSharding
from tests.helpers import (
    GRAD_RTOL,
    LOSS_RTOL,
    PARAM_RTOL,
    build_dtmega_llama,
    clone_module,
    debug_llama,
    first_copy_mesh,
    full,
    relative_error,
)
from tests.interop_models import hf_tiny_llama, torchtitan_debug_llama

SEQ = 32
# document lengths per sample: a one-token document, a sample that is one document, and mixes
LENGTHS = [[1, 9, 22], [SEQ], [5, 5, 6, 16], [20, 11, 1]]

PLANS = {
    "one_rank_flex": (dict(), [DocumentMasking()]),
    "one_rank_sdpa": (dict(), [DocumentMasking(backend="sdpa")]),
    "tp2_sp": (dict(tp=2), [TensorParallel(), SequenceParallel(), DocumentMasking()]),
    "pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DocumentMasking(), DataParallel("ddp")]),
    "pp2_tp2": (dict(pp=2, tp=2), [TensorParallel(), PipelineSplit(microbatches=2), DocumentMasking(),
                                   DataParallel("ddp")]),
    "fsdp2": (dict(dp_shard=2), [DocumentMasking(), DataParallel("fsdp")]),
    "full_recompute_fsdp2": (dict(dp_shard=2), [Recompute("full"), DocumentMasking(), DataParallel("fsdp")]),
    "selective_recompute_tp2": (dict(tp=2), [TensorParallel(), SequenceParallel(), Recompute("selective"),
                                             DocumentMasking()]),
    "compiled_fused": (dict(), [FuseKernels(), DocumentMasking(), Compile()]),
    "ep2_moe": (dict(ep=2), [ExpertParallel(), DocumentMasking(), DataParallel("fsdp")]),
    "cp2_a2a": (dict(cp=2), [ContextParallel(method="a2a"), DocumentMasking(), DataParallel("fsdp")]),
    "cp2_a2a_tp2": (dict(cp=2, tp=2), [TensorParallel(), SequenceParallel(), DocumentMasking(),
                                       ContextParallel(method="a2a"), DataParallel("fsdp")]),
    "cp2_ring": (dict(cp=2), [ContextParallel(method="ring"), DocumentMasking(), DataParallel("fsdp")]),
    "cp2_all_gather_tp2": (dict(cp=2, tp=2), [TensorParallel(), SequenceParallel(), DocumentMasking(),
                                              ContextParallel(method="all_gather"), DataParallel("fsdp")]),
}


def packed_batch(step: int, vocab: int, rows: int = 4):
    """Samples packing LENGTHS' documents, some tokens not counted in the loss."""
    generator = torch.Generator().manual_seed(60 + step)
    tokens = torch.randint(0, vocab, (rows, SEQ), generator=generator)
    labels = torch.randint(0, vocab, (rows, SEQ), generator=generator)
    mask = (torch.rand(rows, SEQ, generator=generator) > 0.2).float()
    documents = dtmega.document_ids_from_lengths(LENGTHS[:rows], SEQ)
    return dtmega.make_batch(tokens, labels, mask, document_ids=documents)


def each_document_alone(logits_of, batch) -> torch.Tensor:
    """Per-token cross entropy [B, S] from running every document of every sample by itself
    (`logits_of(tokens)`: the unsharded model's logits)."""
    out = torch.zeros(batch["tokens"].shape)
    for row, lengths in enumerate(LENGTHS[:batch["tokens"].shape[0]]):
        start = 0
        for length in lengths:
            piece = slice(start, start + length)
            logits = logits_of(batch["tokens"][row:row + 1, piece])
            out[row, piece] = per_token_cross_entropy(logits, batch["labels"][row:row + 1, piece])[0]
            start += length
    return out


def train_against_each_document_alone(pm, reference, logits_of, vocab: int, steps: int) -> None:
    """`steps` AdamW steps of the plan and of the reference on packed batches: the plan's loss
    equals the documents' losses alone every step, every gradient at the first, every parameter
    at the end."""
    params = dict(reference.named_parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-5)
    par_opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-5)
    for step in range(steps):
        batch = packed_batch(step, vocab)
        ref_opt.zero_grad()
        expected = (each_document_alone(logits_of, batch) * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
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


def config_for(name: str) -> LlamaConfig:
    if name.startswith("ep"):  # dropless routing is per token; no balancing or z loss (statistics of a batch)
        config = LlamaConfig.from_name("debug-moe")
        return config.replace(moe=dataclasses.replace(config.moe, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                                                      capacity_factor=None))
    return debug_llama(tie_embeddings=False) if "pp" in name else debug_llama()


@pytest.mark.parametrize("name", list(PLANS))
def test_packed_documents_equal_each_document_alone_under_every_plan(name):
    sizes, passes = PLANS[name]
    config = config_for(name)
    reference, meta_copy = build_dtmega_llama(config, seed=31)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=31)
    assert pm.batch_fields == ("document_ids",)
    train_against_each_document_alone(pm, reference, reference, config.vocab_size, steps=5)


HF_PLANS = {
    "hf_one_rank": (dict(), [DocumentMasking()]),
    "hf_tp2_sp_fsdp2": (dict(tp=2, dp_shard=2), [TensorParallel(), SequenceParallel(), DocumentMasking(),
                                                 DataParallel("fsdp")]),
}


@pytest.mark.parametrize("name", list(HF_PLANS))
def test_hugging_face_llama_masks_packed_documents_by_restarting_positions(name):
    """transformers finds packed sequences in position ids that restart per document; the pass
    sets them from the document ids, so HF's LlamaForCausalLM equals each document alone too."""
    sizes, passes = HF_PLANS[name]
    reference = hf_tiny_llama(seed=12)
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(**sizes), dtmega.Plan(passes))
    train_against_each_document_alone(pm, reference, lambda tokens: reference(input_ids=tokens, use_cache=False).logits,
                                      256, steps=3)
    with pytest.raises(PlanError, match="position ids that restart at every document"):
        batch = packed_batch(9, 256)
        pm.forward_backward(pm.shard_batch(dtmega.make_batch(
            batch["tokens"], batch["labels"], batch["loss_mask"], torch.arange(SEQ).expand(4, SEQ).clone(),
            document_ids=batch["document_ids"])))


TORCHTITAN_PLANS = {
    "tt_tp2_sp_cp2_ring": (dict(tp=2, cp=2), [TensorParallel(), SequenceParallel(), DocumentMasking(),
                                              ContextParallel(method="ring"), DataParallel("fsdp")]),
    "tt_pp2": (dict(pp=2), [PipelineSplit(microbatches=2), DocumentMasking(), DataParallel("ddp")]),
}


@pytest.mark.parametrize("name", list(TORCHTITAN_PLANS))
def test_torchtitan_llama_masks_packed_documents_through_its_family(name):
    """torchtitan's Llama, unedited: the pass puts dtmega's document core where its inner
    attention was (context parallelism's core reads the ids itself), the family passes the ids
    as torchtitan's attention_masks and the restarting positions to its RoPE."""
    sizes, passes = TORCHTITAN_PLANS[name]
    reference = torchtitan_debug_llama(seed=14)
    pm = dtmega.parallelize(clone_module(reference), first_copy_mesh(**sizes), dtmega.Plan(passes))
    train_against_each_document_alone(pm, reference, lambda tokens: reference(tokens), 2048, steps=2)


@pytest.mark.parametrize("method", ["ring", "all_gather"])
def test_blockwise_context_parallelism_deals_documents_and_skips_masked_blocks(method):
    """CP4 on samples of short documents: the tokens are dealt by document work, the logits equal
    each document alone, and blocks of keys sharing no document with the queries are skipped."""
    config = debug_llama()
    reference, meta_copy = build_dtmega_llama(config, seed=33)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(cp=4), dtmega.Plan([
        ContextParallel(method=method, load_balance=None), DocumentMasking(), DataParallel("ddp")]))
    pm.init_weights(seed=33)
    assert pm.hook(SequenceSharding).by_documents
    tokens = torch.randint(0, config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(5))
    documents = dtmega.document_ids_from_lengths([[4] * 8], SEQ)
    stats = pm.hook(SequenceSharding).comm
    with torch.no_grad():
        logits = full(pm(tokens, document_ids=documents))
        expected = torch.cat([reference(tokens[:, s:s + 4]) for s in range(0, SEQ, 4)], dim=1)
    assert relative_error(logits, expected) < LOSS_RTOL
    # contiguous shards of 4-token documents: each rank's queries see only its own keys
    layers = config.n_layers
    assert (stats.blocks_attended, stats.blocks_skipped) == (layers, 3 * layers)
