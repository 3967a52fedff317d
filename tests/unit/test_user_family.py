"""A model family added from a folder outside the package (tests/families/tiny_gpt: its model,
its family registration and its named model, nothing else touched) is planned, sized by the
cost model from its own facts, and launched by the trainer like dtmega's Llama."""

from __future__ import annotations

import json

import torch

import dtmega
from dtmega.cli import main
from dtmega.passes import DataParallel, Plan, SequenceParallel, TensorParallel
from tests.families.tiny_gpt.model import TinyGPT, TinyGPTConfig
from tests.helpers import mesh_shape
from tests.train_helpers import prepare_corpus

CUSTOM = ["--custom-import", "tests.families.tiny_gpt"]


def test_a_family_of_ones_own_is_planned_from_its_rules_and_facts():
    with torch.device("meta"):
        model = TinyGPT(TinyGPTConfig())
    layout = dtmega.check_plan(model, mesh_shape(tp=2, dp_shard=2),
                               Plan([TensorParallel(), SequenceParallel(), DataParallel("fsdp")]))
    assert layout["blocks.0.attn.q"].params["weight"].placements == {"tp": "S(0)", "dp_shard": "S(0)"}
    assert layout["blocks.1.mlp.down"].style == "rowwise" and layout["ln_f"].style == "sequence_norm"


def test_dtmega_plan_reads_its_shapes_from_the_family(capsys):
    assert main(["plan", *CUSTOM, "--model", "tiny-gpt", "--gpus", "8", "--gpu", "h100", "--seq-length", "256",
                 "--global-batch-size", "64", "--json", "--top", "1"]) == 0
    (best,) = json.loads(capsys.readouterr().out)
    assert best["tokens_per_s_per_gpu"] > 0 and best["tflops_per_rank"] > 0
    from dtmega.cost.analysis import model_shape_of_spec
    from dtmega.models import model_spec

    shape = model_shape_of_spec(model_spec("tiny-gpt"))  # the family's facts, not a Llama config
    assert (shape.dim, shape.layers, shape.heads, shape.ffn, shape.vocab) == (64, 2, 4, 128, 256)


def test_the_trainer_launches_it(tmp_path, capsys):
    corpus = prepare_corpus(tmp_path, documents=60)
    assert main(["train", *CUSTOM, "--model", "tiny-gpt", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--use-distributed-optimizer", "--data-path", corpus, "--tokenizer-type", "byte", "--seq-length", "64",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3",
                 "--dry-run", "4"]) == 0
    assert "plan check out; nothing ran" in capsys.readouterr().out
