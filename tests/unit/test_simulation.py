"""The llama3-405b plan TP8 x FSDP64 (512 ranks, fake process group) on the meta device: under
30 s and 4 GB, no parameter storage, and the exact per-rank parameter count."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from dtmega.models import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]


def _chunk(n: int, parts: int) -> int:
    """Rank 0's share of n rows split the way torch.chunk (and so DTensor and FSDP2) splits."""
    return math.ceil(n / parts)


def expected_rank0_params(config: LlamaConfig, tp: int, dp: int) -> int:
    """Parameters on rank 0 with TP (rows or columns by tp) then FSDP (rows by dp), by hand."""
    d, f, hd = config.dim, config.ffn_dim, config.head_dim
    colwise = lambda rows, cols: _chunk(_chunk(rows, tp), dp) * cols  # noqa: E731
    rowwise = lambda rows, cols: _chunk(rows, dp) * (cols // tp)  # noqa: E731
    per_layer = (
        colwise(config.n_heads * hd, d) + 2 * colwise(config.n_kv_heads * hd, d) + rowwise(d, config.n_heads * hd)
        + 2 * colwise(f, d) + rowwise(d, f) + 2 * _chunk(d, dp)
    )
    embeddings = 2 * colwise(config.vocab_size, d)
    return config.n_layers * per_layer + embeddings + _chunk(d, dp)


def test_llama3_405b_on_512_simulated_ranks():
    command = [sys.executable, str(ROOT / "examples" / "simulate_plan.py"), "--model", "llama3-405b",
               "--world", "512", "--tp", "8", "--json"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=120, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 64, "ep": 1, "cp": 1, "tp": 8}
    assert result["seconds"] < 30, result
    assert result["max_rss_gib"] < 4, result
    assert result["all_meta"], "a parameter was materialized"
    expected = expected_rank0_params(LlamaConfig.from_name("llama3-405b"), tp=8, dp=64)
    assert expected == 792_755_456
    assert result["local_params"] == expected
    assert result["layout_local_params"] == expected
    assert result["global_params"] == 405_853_388_800
