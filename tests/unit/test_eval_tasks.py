"""`dtmega evaluate --task wikitext|lambada`: the windows are Megatron's, the perplexity equals a
direct computation of the same windows, the adjusted perplexity follows the documented formula,
and LAMBADA's accuracy equals a hand count (strict and not) on a model whose predictions are
known by construction."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import dtmega
from dtmega.passes import Plan
from dtmega.tasks import lambada, wikitext
from dtmega.tasks.run import evaluate_lambada, evaluate_wikitext
from tests.task_models import BYTES, LAMBADA_ANSWERS, LAMBADA_PASSAGES, next_letter_model, small_model, wikitext_sample


def megatron_scored_targets(num_tokens: int, seq_length: int, overlap: int) -> list[tuple[int, int]]:
    """(window start, target index) pairs Megatron's _LMDataset scores, written from its
    definition: ceil((T - 1 - overlap) / overlap) + 1 windows, each at idx * overlap; a window
    after the first scores only its last `overlap` positions; padding scores nothing."""
    count = max(math.ceil(max(num_tokens - 1 - overlap, 0) / overlap) + 1, 1)
    scored = []
    for idx in range(count):
        start = idx * overlap
        for position in range(seq_length):
            target = start + position  # predicts token target + 1
            if target + 1 >= num_tokens:
                continue
            if overlap != seq_length and idx != 0 and position < seq_length - overlap:
                continue
            scored.append((start, target))
    return scored


@pytest.mark.parametrize("num_tokens,seq_length,overlap", [
    (2, 8, 8), (9, 8, 8), (10, 8, 8), (100, 8, 8), (100, 8, 3), (101, 16, 1), (17, 16, 32), (50, 64, 32),
    *[(random.Random(i).randint(2, 300), 16, random.Random(i + 99).randint(1, 16)) for i in range(12)],
])
def test_windows_score_what_megatron_scores_each_target_once(num_tokens, seq_length, overlap):
    ours = [(w.start, w.start + p) for w in wikitext.windows(num_tokens, seq_length, overlap)
            for p in range(w.scored_from, seq_length) if w.start + p + 1 < num_tokens]
    assert sorted(ours) == sorted(megatron_scored_targets(num_tokens, seq_length, min(overlap, seq_length)))
    assert sorted(t for _, t in ours) == list(range(num_tokens - 1))


def test_detokenizer_undoes_wikitexts_tokenization():
    raw = ' = = Early life = = \n He was born in 1 @,@ 024 , the 3 @.@ 5 @-@ year ( " old " ) town \'s son . \n'
    assert wikitext.detokenize(raw) == ' == Early life ==\nHe was born in 1,024, the 3.5-year ("old") town\'s son.\n'
    assert wikitext.count_words(raw) == len(raw.strip().split(" "))


def test_wikitext_perplexity_equals_a_direct_computation_of_the_same_windows(one_rank_mesh, tmp_path):
    raw = wikitext_sample()
    path = tmp_path / "wiki.test.tokens"
    path.write_text(raw)
    model = small_model()
    pm = dtmega.parallelize(model, dtmega.make_mesh(device_type="cpu"), Plan([]))
    result = evaluate_wikitext(pm, BYTES, str(path), seq_length=32, overlapping_eval=8, micro_batch=3)

    tokens = torch.tensor(BYTES.encode(wikitext.detokenize(raw)))
    total = 0.0
    with torch.no_grad():
        for window in wikitext.windows(len(tokens), 32, 8):
            piece = tokens[window.start:window.start + 33]
            logits = model(piece[None, :-1])[0]
            losses = torch.nn.functional.cross_entropy(logits.float(), piece[1:], reduction="none")
            total += float(losses[window.scored_from:].sum())
    expected_loss = total / (len(tokens) - 1)
    assert result.tokens == len(tokens) and result.words == len(raw.strip().split(" "))
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)  # fp32 sums in other orders
    assert result.perplexity == pytest.approx(math.exp(expected_loss), rel=1e-5)
    # adjusted perplexity: exp(loss x (tokens - 1) / (words - 1)), the per-word perplexity
    assert result.adjusted_perplexity == pytest.approx(math.exp(total / (result.words - 1)), rel=1e-5)
    assert result.adjusted_perplexity == pytest.approx(
        math.exp(result.loss * (result.tokens - 1) / (result.words - 1)), rel=1e-9)


def test_lambada_accuracy_equals_a_hand_count(one_rank_mesh, tmp_path):
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in LAMBADA_PASSAGES))
    pm = dtmega.parallelize(next_letter_model(), dtmega.make_mesh(device_type="cpu"), Plan([]))
    loose = evaluate_lambada(pm, BYTES, str(path), strict=False, context=64, micro_batch=4)
    strict = evaluate_lambada(pm, BYTES, str(path), strict=True, context=64, micro_batch=4)
    assert (loose.correct, loose.total) == (LAMBADA_ANSWERS[False], 6)
    assert (strict.correct, strict.total) == (LAMBADA_ANSWERS[True], 6)
    assert strict.accuracy == pytest.approx(2 / 6)


@pytest.mark.parametrize("content,message", [
    ("not json\n", "lambada.jsonl:1 is not a JSON line"),
    ('{"text": "fine passage"}\n{"txt": "x"}\n', "lambada.jsonl:2 has no non-empty \"text\" field"),
    ('{"text": "word"}\n', "lambada.jsonl:1: the passage is too short"),
    ('{"text": "' + "long " * 40 + 'end"}\n', "more than the model's context of 64"),
    ("\n", "holds no passages"),
])
def test_lambada_file_problems_are_named_with_the_line(tmp_path, content, message):
    path = tmp_path / "lambada.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lambada.read_examples(path, BYTES, strict=True, max_tokens=64)


@pytest.mark.parametrize("argv,message", [
    (["--task", "wikitext"], "--task wikitext needs --valid-data FILE"),
    (["--task", "lambada", "--valid-data", "x", "--data-path", "d"], "evaluates --valid-data, not --data-path"),
    (["--valid-data", "x"], "give --data-path"),
    (["--data-path", "d", "--strict-lambada"], "belong to --task"),
    (["--task", "wikitext", "--valid-data", "/nonexistent/wiki.test.tokens"],
     "--valid-data /nonexistent/wiki.test.tokens is not a file"),
    (["--task", "wikitext", "--valid-data", __file__, "--strict-lambada"], "--strict-lambada applies to --task lambada"),
    (["--task", "wikitext", "--valid-data", __file__, "--overlapping-eval", "0"], "--overlapping-eval 0 must be at least 1"),
    (["--task", "wikitext", "--valid-data", "x", "--split", "1,0,0", "--eval-iters", "3"],
     "--split, --eval-iters belong(s) to the split evaluation"),
])
def test_evaluate_task_arguments_are_checked_before_loading(argv, message, capsys):
    from dtmega.cli import main

    assert main(["evaluate", "--load", "/nonexistent/checkpoint", *argv]) == 2
    assert message in capsys.readouterr().err
