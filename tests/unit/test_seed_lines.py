"""The seeds' two launch lines (tests/seed_lines.py says how they are rebuilt) pass `--dry-run`
for their worlds (64 and 32) with Megatron's parameter counts, counted layer by layer in the test:
before issue 51 both were refused ("GPT blocks ... not supported yet", then tied embeddings
across pipeline stages)."""

from __future__ import annotations

import shlex

import pytest

from dtmega.cli import main
from tests.seed_lines import LLAMA_70B_3D, MOCK_GPT2_DATA, MOE_TP2_EP4, WORLDS, megatron_gpt_count, padded

EXPECTED = {
    # 80 x (12 h^2 + 13 h) + GPT-2's 50,257 tokens padded for TP 4 (50,688) x h + 4,096 positions x h + 2 h
    "llama_70b_3d": megatron_gpt_count(80, 8192, padded(50257, 4), 4096),
    # 24 blocks of 8 GeLU experts (no biases) of 4 x 2,048, top-2, tied embeddings padded for TP 2
    "moe_tp2_ep4": megatron_gpt_count(24, 2048, padded(50257, 2), 4096, experts=8, biases=False),
}


@pytest.mark.parametrize("name, line", [("llama_70b_3d", LLAMA_70B_3D), ("moe_tp2_ep4", MOE_TP2_EP4)])
def test_the_seed_line_passes_its_dry_run_with_megatrons_count(name, line, capsys):
    assert main(["train", *shlex.split(line), *MOCK_GPT2_DATA, "--dry-run", str(WORLDS[name])]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"dry run for {WORLDS[name]} ranks: {EXPECTED[name]:,} parameters" in out, out[-600:]
    assert "GPT" in out


def test_the_70b_line_is_megatrons_64_9_billion_parameter_gpt():
    assert EXPECTED["llama_70b_3d"] == 64_881_836_032
