"""Megatron-LM's own functional-test configurations for GPT, MoE and Mixtral (issue 51, item 5):
each one's MODEL_ARGS (copied with its Megatron-LM commit in tests/data, by
tests/scripts/copy_megatron_functional_args.py) as a `dtmega train --dry-run` line on the world its
sizes imply (tests/megatron_functional.py says what is swapped and why). Before this issue 0 of
279 passed. The share is held from below (ACCEPTED_AT_LEAST: a change that refuses more fails),
every refusal is a not-built row or a named start-up check, and docs/training.md's table is the
measured one, row for row."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from tests.megatron_functional import configurations, docs_table, summarize, verdict

ROOT = Path(__file__).resolve().parents[2]
# measured at d98e8a64dd: 133 of 279; the goal is 90 % (252), not reached (docs/training.md)
ACCEPTED_AT_LEAST = 151


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    commit, configs = configurations()
    scratch = tmp_path_factory.mktemp("functional")
    found = []
    for index, (name, model_args) in enumerate(sorted(configs.items())):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            found.append(verdict(name, model_args, scratch / str(index)))
    return commit, found


def test_the_copy_holds_every_configuration_of_the_three_families(verdicts):
    commit, found = verdicts
    assert len(commit) == 40 and len(found) == 279
    assert {item.name.split("/")[0] for item in found} == {"gpt", "moe", "mixtral"}


def test_the_accepted_share_does_not_fall(verdicts):
    _, found = verdicts
    accepted, _ = summarize(found)
    assert accepted >= ACCEPTED_AT_LEAST, [item.name for item in found if item.refusal is None]


def test_the_docs_table_is_the_measured_one(verdicts):
    commit, found = verdicts
    accepted, categories = summarize(found)
    text = (ROOT / "docs" / "training.md").read_text()
    held = text.split("<!-- functional-tests-table -->", 2)[1].strip()
    assert held == docs_table(commit, len(found), accepted, categories)


def test_a_gpt3_config_passes_with_megatrons_own_model(verdicts):
    """One accepted line, looked at: Megatron's GPT-3 TP2 PP2 functional test builds GPT blocks with
    GPT-2's vocabulary padded as Megatron pads it for TP 2 (a multiple of 128 x 2: 50,432)."""
    from dtmega.train.args import parse_train_args
    from dtmega.train.prepare import model_of

    _, found = verdicts
    item = next(item for item in found if item.name == "gpt/gpt3_mcore_te_tp2_pp2")
    assert item.refusal is None and item.world == 4
    spec, config = model_of(parse_train_args(list(item.argv))[0], tokenizer_vocab=50257)
    assert spec.family == "dtmega-gpt" and config.vocab_size == 50432
