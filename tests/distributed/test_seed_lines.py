"""Tiny versions of the seeds' two launch lines (tests/seed_lines.py) train on 4 CPU ranks with the
loss falling: every flag as written but the sizes, shrunk (the model to 2-4 blocks of 64, the
parallel sizes to fit 4 ranks: TP 2 x PP 2 for the 3D line, TP 2 x EP 2 for the MoE line), the
data the suite's corpus, fp32 (the CPU's bf16 is slow), and 20 steps at a higher learning rate."""

from __future__ import annotations

import shlex

import pytest

from tests.seed_lines import LLAMA_70B_3D, MOE_TP2_EP4
from tests.train_helpers import train_reusing_meshes as train

SHRUNK = {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "2",
          "--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
          "--max-position-embeddings": "32", "--global-batch-size": "8", "--micro-batch-size": "2",
          "--train-iters": "20", "--lr": "3e-3", "--min-lr": "3e-4", "--lr-warmup-iters": "2", "--log-interval": "5",
          "--save-interval": None, "--eval-interval": "20", "--eval-iters": "1", "--bf16": None}


def shrunk(line: str, corpus: str) -> list[str]:
    """The line with SHRUNK's values (None: the flag left out) and the corpus as its data."""
    tokens, out = shlex.split(line), []
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        takes_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
        value = tokens[i + 1] if takes_value else None
        i += 2 if takes_value else 1
        if flag in SHRUNK:
            if SHRUNK[flag] is not None:
                out += [flag, SHRUNK[flag]]
            continue
        out += [flag] + ([value] if value is not None else [])
    return out + ["--data-path", corpus, "--split", "90,10,0", "--tokenizer-type", "byte", "--seed", "7"]


@pytest.mark.parametrize("name, line", [("llama_70b_3d", LLAMA_70B_3D), ("moe_tp2_ep4", MOE_TP2_EP4),
                                        ("moe_tp2_ep4_etp1", MOE_TP2_EP4 + " --expert-tensor-parallel-size 1")])
def test_a_tiny_version_of_the_seed_line_trains_with_the_loss_falling(name, line, corpus):
    # the 3D line: GPT blocks on TP 2 x PP 2, the embedding tied across the two stages, dropout 0.1;
    # the MoE line: GeLU experts on TP 2 x EP 2; with ETP 1 (Megatron's folding) the experts are
    # whole, one pair per TP rank of each data-parallel pair's EP 2
    result = train(shrunk(line, corpus))
    assert len(result.losses) == 20
    first, last = sum(result.losses[:3]) / 3, sum(result.losses[-3:]) / 3
    assert last < 0.8 * first, (name, result.losses)
