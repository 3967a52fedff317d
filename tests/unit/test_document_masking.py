"""Packed documents on one process: the ids, the masks, the model against each document alone,
the FlexAttention path's memory, Megatron's --reset-attention-mask, and bad input.

Exactness is fp32 at the suite's 1e-5 (tests/helpers.py): the masked packed sample and the
document by itself compute the same softmax over the same keys, summed in another order. Plans
(TP, PP, FSDP, EP, recompute, compiled blocks) are tests/distributed/test_document_masking.py."""

from __future__ import annotations

import math

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
    flex_document_attention,
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



def test_flexattentions_training_path_saves_no_sequence_by_sequence_tensor_at_8192(monkeypatch):
    """Must-show 3 for FlexAttention itself: the autograd path CUDA trains with (FlexAttention's
    own autograd function, which the compiled kernel saves the same tensors for) traced at S =
    8192 on the meta device, since torch refuses CPU inputs that require grad. Everything saved
    is q, k, v, the output, the log-sum-exp and max rows, the BlockMask's (S/128)-sized index
    tables and the ids: nothing of S x S, and the backward runs through."""
    import torch.nn.attention.flex_attention as flex_module

    seq = 8192
    ids = dtmega.document_ids_from_lengths([[1000, 3000, 192, 4000]], seq)
    block_mask = document_block_mask(ids).to("meta")
    on_meta = ids.to("meta")
    block_mask.mask_mod = lambda b, h, q_idx, kv_idx: (on_meta[b, q_idx] == on_meta[b, kv_idx]) & (kv_idx <= q_idx)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # meta is not a device it lists
    q, k, v = (torch.randn(1, 4, seq, 64, device="meta", requires_grad=True) for _ in range(3))
    shapes: list[tuple[int, ...]] = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flex_document_attention(q, k, v, block_mask, compiled=False)
    out.sum().backward()
    assert q.grad.shape == q.shape and (1, 4, seq, 64) in shapes and len(shapes) >= 5
    assert max(math.prod(shape) for shape in shapes) == 4 * seq * 64, shapes
    assert not any(shape.count(seq) >= 2 for shape in shapes), shapes

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
    from tests.interop_models import hf_tiny_mixtral

    with pytest.raises(PlanError, match="document masking needs a model whose forward takes document ids"):
        dtmega.check_plan(hf_tiny_mixtral(), {}, dtmega.Plan([DocumentMasking()]))


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
    L/S of causal attention over the sample, under each context-parallel method (ring's transfers
    then hide under far less attention), and the flags ask for --reset-attention-mask."""
    from dtmega.cost.hardware import BUILT_IN
    from dtmega.cost.plan_cli import model_shape_for
    from dtmega.cost.plan_flags import train_options
    from dtmega.cost.search import RunWorkload, search

    model, hardware = model_shape_for("llama3-8b"), BUILT_IN["h100"]
    causal = search(model, 8, 8, RunWorkload(65536, 8), hardware, max_micro_batch=1)
    packed = search(model, 8, 8, RunWorkload(65536, 8, document_length=1024), hardware, max_micro_batch=1)
    for result in (causal, packed):
        assert {"ring", "all_gather", "a2a"} <= {c.plan.cp_method for c in result.ranked if c.plan.cp > 1}
    ring = [next(c for c in r.ranked if (c.plan.tp, c.plan.cp, c.plan.cp_method, c.plan.recompute) ==
                 (1, 8, "ring", "none")) for r in (causal, packed)]
    assert ring[1].step_s < ring[0].step_s
    same = next(c for c in causal.ranked if (c.plan.tp, c.plan.cp, c.plan.cp_method) == (1, 8, "a2a")
                and c.plan.recompute == "none")
    masked = next(c for c in packed.ranked if (c.plan.tp, c.plan.cp) == (1, 8) and c.plan.recompute == "none")
    assert masked.step_s < 0.5 * same.step_s  # at 64k tokens attention is most of the step; 1/64 of it remains
    assert masked.flops < same.flops and 0 < masked.mfu < 1
    assert train_options(packed.ranked[0].plan, model, RunWorkload(65536, 8, document_length=1024))[
        "reset_attention_mask"] is True


def test_a_launch_line_with_documents_plans_every_context_parallel_method(tmp_path, capsys):
    """--reset-attention-mask with --context-parallel-size 2 and each --cp-comm-type (Megatron's
    default p2p is ring): the dry run plans document masking under it."""
    from dtmega.cli import main

    corpus = prepare_corpus(tmp_path, documents=60)
    line = tiny_args(corpus, reset_attention_mask=True, context_parallel_size=2)
    for method in ("p2p", "all_gather", "a2a"):
        assert main(["train", *line, "--cp-comm-type", method, "--dry-run", "2"]) == 0
        out = capsys.readouterr().out
        assert "DocumentMasking" in out and "attention.context_parallel." in out


def _reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False, is_causal=None):
    """torch's varlen_attn contract, computed per segment on CPU (the flash kernel is CUDA-only)."""
    causal = window_size == (-1, 0) if is_causal is None else is_causal
    bounds = cu_seq_q.tolist()
    assert bounds == cu_seq_k.tolist() and max_q == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[a:b].transpose(0, 1), key[a:b].transpose(0, 1), value[a:b].transpose(0, 1), is_causal=causal,
        scale=scale, enable_gqa=enable_gqa).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])])


def _old_reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
    """The signature of torch releases before window_size (e.g. the GPU machines' 2.11)."""
    return _reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal, scale=scale)


@pytest.mark.parametrize("kernel", [_reference_varlen, _old_reference_varlen], ids=["window_size", "is_causal"])
def test_the_cuda_varlen_flash_call_packs_documents_into_cumulative_lengths(kernel):
    """The plumbing of the CUDA path (cumulative lengths across rows, causal spelled for the
    torch at hand, GQA passed or repeated) against per-document SDPA, with torch's kernel
    replaced by its contract computed on CPU."""
    from dtmega.kernels.document_attention import flash_varlen_document_attention, varlen_document_attention

    generator = torch.Generator().manual_seed(4)
    ids = dtmega.document_ids_from_lengths([[1, 9, 22], [32], [5, 27]], 32)
    q = torch.randn(3, 32, 4, 8, generator=generator)
    k, v = (torch.randn(3, 32, 2, 8, generator=generator) for _ in range(2))
    got = flash_varlen_document_attention(q, k, v, ids, 0.3, varlen_attn=kernel)
    assert relative_error(got, varlen_document_attention(q, k, v, ids, 0.3)) <= 1e-6
