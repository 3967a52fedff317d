"""Packed documents on one process: the ids, the masks, the model against each document alone,
the FlexAttention path's memory, Megatron's --reset-attention-mask, and bad input.

Exactness is fp32 at the suite's 1e-5 (tests/helpers.py): the masked packed sample and the
document by itself compute the same softmax over the same keys, summed in another order. Plans
(TP, PP, FSDP, EP, recompute, compiled blocks) are tests/distributed/test_document_masking.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtmega
from dtmega.data.loader import sample_to_fields
from dtmega.kernels import per_token_cross_entropy
from dtmega.kernels.document_attention import (
    check_document_ids,
    dense_document_mask,
    document_attention,
    document_block_mask,
    document_mask,
    positions_from_documents,
)
from dtmega.passes import DocumentMasking, PlanError
from dtmega.train.args import parse_train_args
from dtmega.train.setup import build_plan, run_shape
from dtmega.train.trainer import train
from tests.helpers import GRAD_RTOL, LOSS_RTOL, build_dtmega_llama, debug_llama, relative_error
from tests.train_helpers import prepare_corpus, tiny_args

LENGTHS = [[1, 9, 22], [32], [20, 11, 1]]


def test_ids_from_lengths_and_end_of_document_tokens_and_positions_restart():
    ids = dtmega.document_ids_from_lengths([[1, 3], [4]], 4)
    assert ids.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0]]
    assert positions_from_documents(ids).tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]]
    eod = 9
    tokens = torch.tensor([[5, 9, 6, 7, 9, 9, 3]])
    assert dtmega.document_ids_from_eod(tokens, eod).tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    with pytest.raises(dtmega.DtmegaError, match="sum to 3, not the sample length 4"):
        dtmega.document_ids_from_lengths([[1, 2]], 4)
    with pytest.raises(dtmega.DtmegaError, match="must all be >= 1"):
        dtmega.document_ids_from_lengths([[0, 4]], 4)


def test_the_dense_mask_is_causal_within_documents_only():
    mask = dense_document_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(mask, expected.bool())


def _alone(model, tokens, labels, lengths):
    out = torch.zeros(tokens.shape)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            piece = slice(start, start + length)
            out[row, piece] = per_token_cross_entropy(model(tokens[row:row + 1, piece]), labels[row:row + 1, piece])[0]
            start += length
    return out


@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_the_model_on_packed_documents_equals_each_document_alone(backend):
    """Per-token losses and every gradient: documents of 1 token, of the whole sample, and mixed."""
    reference, _ = build_dtmega_llama(debug_llama(), seed=5)
    packed, _ = build_dtmega_llama(debug_llama(), seed=5)
    packed.document_backend = backend
    generator = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 256, (3, 32), generator=generator)
    labels = torch.randint(0, 256, (3, 32), generator=generator)
    ids = dtmega.document_ids_from_lengths(LENGTHS, 32)
    expected = _alone(reference, tokens, labels, LENGTHS)
    got = per_token_cross_entropy(packed(tokens, document_ids=ids), labels)
    assert relative_error(got, expected) <= LOSS_RTOL
    expected.sum().backward()
    got.sum().backward()
    grads = dict(reference.named_parameters())
    for name, param in packed.named_parameters():
        assert relative_error(param.grad, grads[name].grad) <= GRAD_RTOL, name


def test_flexattention_forward_on_cpu_equals_each_document_alone_and_has_no_backward_there():
    """FlexAttention's BlockMask path, compiled, forward only on CPU (torch has no CPU backward:
    the pass refuses backend='flex' for a CPU plan and picks 'varlen')."""
    reference, _ = build_dtmega_llama(debug_llama(), seed=5)
    packed, _ = build_dtmega_llama(debug_llama(), seed=5)
    packed.document_backend = "flex"
    generator = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 256, (3, 32), generator=generator)
    labels = torch.randint(0, 256, (3, 32), generator=generator)
    ids = dtmega.document_ids_from_lengths(LENGTHS, 32)
    with torch.no_grad():
        expected = _alone(reference, tokens, labels, LENGTHS)
        got = per_token_cross_entropy(packed(tokens, document_ids=ids), labels)
    assert relative_error(got, expected) <= LOSS_RTOL
    _, meta_copy = build_dtmega_llama(debug_llama(), seed=5)
    with pytest.raises(PlanError, match=r"backend='flex'\) on cpu: torch has no FlexAttention backward"):
        dtmega.check_plan(meta_copy(), {}, dtmega.Plan([DocumentMasking(backend="flex")]))
    layout = dtmega.check_plan(meta_copy(), {}, dtmega.Plan([DocumentMasking()]))
    assert layout["layers.0.attention.core"].kernel == "attention.document.varlen"


def test_without_document_ids_attention_spans_the_whole_sample():
    """The mask is what makes the difference (a test that could not fail otherwise)."""
    model, _ = build_dtmega_llama(debug_llama(), seed=5)
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(7))
    ids = dtmega.document_ids_from_lengths([[10, 22]], 32)
    positions = positions_from_documents(ids)
    with torch.no_grad():
        masked, plain = model(tokens, positions, document_ids=ids), model(tokens, positions)
    assert torch.equal(masked[:, :10], plain[:, :10])  # the first document sees only itself either way
    assert relative_error(masked[:, 10:], plain[:, 10:]) > 1e-3


def _saved_numels(q, k, v, mask) -> list[int]:
    saved: list[int] = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        document_attention(q, k, v, mask).sum().backward()
    return saved


def test_the_cpu_training_path_keeps_no_sequence_by_sequence_tensor_at_8192():
    """Must-show 3 on CPU: everything autograd saves for the path a CPU plan trains with
    ("varlen") at S = 8192 is O(S) per document (q, k, v, output, log-sum-exp): no [S, S] scores
    or mask. The dense path saves its S² mask (checked too, so the test can fail). FlexAttention's
    BlockMask for the same ids is (S/128)² block indices, and it skips the blocks of different
    documents (counted); its backward runs on CUDA only (make gpu-check)."""
    seq = 8192
    ids = dtmega.document_ids_from_lengths([[1000, 3000, 192, 4000]], seq)
    q, k, v = (torch.randn(1, seq, 2, 16, requires_grad=True) for _ in range(3))
    saved = _saved_numels(q, k, v, document_mask(ids, "varlen"))
    assert saved and max(saved) < seq * seq // 100, sorted(saved)[-3:]
    small = 512  # the dense path at a size this machine does in a moment
    small_ids = dtmega.document_ids_from_lengths([[100, 300, 112]], small)
    q, k, v = (torch.randn(1, small, 2, 16, requires_grad=True) for _ in range(3))
    assert max(_saved_numels(q, k, v, document_mask(small_ids, "sdpa"))) >= small * small
    block_mask = document_block_mask(ids)
    assert block_mask.kv_indices.numel() <= (seq // 128) ** 2
    visited = int(block_mask.kv_num_blocks.sum()) + int(block_mask.full_kv_num_blocks.sum())
    causal = (seq // 128) * (seq // 128 + 1) // 2
    assert visited < 0.6 * causal, (visited, causal)


def test_bad_document_ids_and_positions_beyond_the_model_are_refused():
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(dtmega.DtmegaError, match=r"document_ids has shape \[2, 3\] but the tokens \[2, 4\]"):
        check_document_ids(torch.zeros(2, 3, dtype=torch.long), tokens)
    with pytest.raises(dtmega.DtmegaError, match="decrease inside a sample"):
        check_document_ids(torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0]]), tokens)
    _, meta_copy = build_dtmega_llama(debug_llama(max_seq_len=8), seed=5)
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(device_type="cpu"), dtmega.Plan([DocumentMasking()]))
    batch = dtmega.make_batch(torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 10, dtype=torch.long),
                              position_ids=torch.arange(10)[None], document_ids=torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(PlanError, match=r"position 9, but the model has 8 positions \(its RoPE table\)"):
        pm.forward_backward(pm.shard_batch(batch))


def test_a_family_without_document_ids_is_refused_by_the_pass():
    from tests.interop_models import torchtitan_debug_llama

    with pytest.raises(PlanError, match="document masking needs a model whose forward takes document ids"):
        dtmega.check_plan(torchtitan_debug_llama(), {}, dtmega.Plan([DocumentMasking()]))


def test_megatrons_flags_make_document_ids_at_each_end_of_document():
    eod = 0
    window = np.array([[5, 6, 0, 7, 8, 9, 0, 4, 3]])  # S + 1 tokens
    fields = sample_to_fields(window, eod, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    assert fields["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert fields["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert fields["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 1, 0, 1]]
    assert "document_ids" not in sample_to_fields(window, eod, False, False).keys()


def test_dtmega_train_with_reset_attention_mask_trains_within_documents(tmp_path):
    corpus = prepare_corpus(tmp_path, documents=60)
    argv = tiny_args(corpus, train_iters=8, eval_iters=1, eval_interval=8, reset_attention_mask=True,
                     reset_position_ids=True, eod_mask_loss=True)
    args, _ = parse_train_args(argv)
    assert any(isinstance(p, DocumentMasking) for p in build_plan(args, run_shape(args, world=1), 2).passes)
    result = train(argv)
    assert all(np.isfinite(result.losses)) and result.losses[-1] < result.losses[0]


def test_the_planner_counts_the_attention_work_document_masking_does():
    """Issue item 6: with packed documents of mean length L masked per document, attention costs
    L/S of causal attention over the sample; dtmega's CP plans are then all-to-all only (the one
    context-parallel method with document masks), and the flags ask for --reset-attention-mask."""
    from dtmega.cost.hardware import BUILT_IN
    from dtmega.cost.plan_cli import model_shape_for
    from dtmega.cost.plan_flags import train_options
    from dtmega.cost.search import RunWorkload, search

    model, hardware = model_shape_for("llama3-8b"), BUILT_IN["h100"]
    causal = search(model, 8, 8, RunWorkload(65536, 8), hardware, max_micro_batch=1)
    packed = search(model, 8, 8, RunWorkload(65536, 8, document_length=1024), hardware, max_micro_batch=1)
    assert {c.plan.cp_method for c in packed.ranked if c.plan.cp > 1} == {"a2a"}
    assert {"ring", "all_gather"} <= {c.plan.cp_method for c in causal.ranked if c.plan.cp > 1}
    same = next(c for c in causal.ranked if (c.plan.tp, c.plan.cp, c.plan.cp_method) == (1, 8, "a2a")
                and c.plan.recompute == "none")
    masked = next(c for c in packed.ranked if (c.plan.tp, c.plan.cp) == (1, 8) and c.plan.recompute == "none")
    assert masked.step_s < 0.5 * same.step_s  # at 64k tokens attention is most of the step; 1/64 of it remains
    assert masked.flops < same.flops and 0 < masked.mfu < 1
    assert train_options(packed.ranked[0].plan, model, RunWorkload(65536, 8, document_length=1024))[
        "reset_attention_mask"] is True


def test_a_launch_line_with_documents_under_ring_context_parallelism_is_refused_by_a_dry_run(tmp_path, capsys):
    """--reset-attention-mask with --context-parallel-size 2 and Megatron's default --cp-comm-type
    p2p (ring): one line naming the fix, before any process group; with a2a the plan checks."""
    from dtmega.cli import main

    corpus = prepare_corpus(tmp_path, documents=60)
    line = tiny_args(corpus, reset_attention_mask=True, context_parallel_size=2)
    assert main(["train", *line, "--dry-run", "2"]) == 2
    err = capsys.readouterr().err
    assert "document masking under ring context parallelism (--context-parallel-size 2) is not built yet" in err
    assert "ContextParallel(method='a2a') (--cp-comm-type a2a)" in err
    assert main(["train", *line, "--cp-comm-type", "a2a", "--dry-run", "2"]) == 0
