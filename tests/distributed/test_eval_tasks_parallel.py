"""The evaluation tasks under TP2 x DP2 and DP4 give the unsharded model's numbers: WikiText
loss (vocab-parallel cross entropy, windows split over data-parallel ranks, filler rows on ranks
past the last window) and LAMBADA's hand-counted accuracy."""

from __future__ import annotations

import json

import pytest
import torch

import dtmega
from dtmega.models import Llama
from dtmega.passes import DataParallel, Plan, TensorParallel
from dtmega.tasks import wikitext
from dtmega.tasks.run import evaluate_lambada, evaluate_wikitext
from tests.helpers import mesh
from tests.task_models import BYTES, LAMBADA_ANSWERS, LAMBADA_PASSAGES, next_letter_model, small_model, wikitext_sample

PLANS = {
    "tp2_ddp2": (dict(tp=2, dp_replicate=2), [TensorParallel(), DataParallel("ddp")]),
    "ddp4": (dict(dp_replicate=4), [DataParallel("ddp")]),
}


def parallel_copy(reference: Llama, sizes: dict, passes: list) -> dtmega.ParallelModel:
    with torch.device("meta"):
        copy = Llama(reference.config)
    pm = dtmega.parallelize(copy, mesh(**sizes), Plan(passes))
    pm.init_weights(seed=0)
    pm.load_full_state_dict(reference.state_dict())
    return pm


@pytest.mark.parametrize("name", list(PLANS))
def test_wikitext_loss_under_a_plan_equals_the_unsharded_models(name, tmp_path):
    sizes, passes = PLANS[name]
    raw = wikitext_sample(seed=1, words=120)
    path = tmp_path / "wiki.tokens"
    path.write_text(raw)
    reference = small_model(seed=3)
    result = evaluate_wikitext(parallel_copy(reference, sizes, passes), BYTES, str(path), seq_length=32,
                               overlapping_eval=8, micro_batch=2)
    tokens = torch.tensor(BYTES.encode(wikitext.detokenize(raw)))
    total = 0.0
    with torch.no_grad():
        for window in wikitext.windows(len(tokens), 32, 8):
            piece = tokens[window.start:window.start + 33]
            losses = torch.nn.functional.cross_entropy(reference(piece[None, :-1])[0], piece[1:], reduction="none")
            total += float(losses[window.scored_from:].sum())
    assert result.loss == pytest.approx(total / (len(tokens) - 1), rel=1e-5)  # fp32, other reduction orders


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("strict", [False, True])
def test_lambada_accuracy_under_a_plan_equals_the_hand_count(name, strict, tmp_path):
    sizes, passes = PLANS[name]
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in LAMBADA_PASSAGES))
    result = evaluate_lambada(parallel_copy(next_letter_model(), sizes, passes), BYTES, str(path), strict=strict,
                              context=64, micro_batch=1)
    assert (result.correct, result.total) == (LAMBADA_ANSWERS[strict], len(LAMBADA_PASSAGES))
