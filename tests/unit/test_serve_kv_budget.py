"""`dtmega serve` sizes its KV cache from a memory budget (it took 32 slots x the model's whole
context: ~11.25 GiB for SmolLM2-135M at the first request, without a word)."""

from __future__ import annotations

import pytest
import torch

from dtmega.models.llama.config import LlamaConfig
from dtmega.serve.kv_budget import GiB, KVBudget, kv_budget, kv_bytes_per_token, parse_bytes, size_kv_cache

# SmolLM2-135M's shape: 30 blocks, 3 KV heads of 64, an 8192-token context
SMOLLM2 = LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, ffn_dim=1536, max_seq_len=8192)


def test_bytes_per_token_and_slots_follow_the_budget():
    per_token = kv_bytes_per_token(SMOLLM2, tp=1, dtype=torch.float32)
    assert per_token == 2 * 30 * 3 * 64 * 4  # keys and values, every block, fp32
    assert kv_bytes_per_token(SMOLLM2, tp=3, dtype=torch.bfloat16) == 2 * 30 * 1 * 64 * 2
    whole = size_kv_cache(budget=KVBudget(32 * 8192 * per_token, "test"), max_len=8192, bytes_per_token=per_token,
                          max_batch_size=32)
    assert whole.slots == 32 and abs(whole.bytes / GiB - 11.25) < 0.01  # what the old fixed default took
    four = size_kv_cache(budget=KVBudget(4 * GiB, "test"), max_len=8192, bytes_per_token=per_token, max_batch_size=32)
    assert four.slots == 4 * GiB // (8192 * per_token) == 11 and four.bytes <= 4 * GiB
    assert "11 slots x 8192 positions = 3.87 GiB per rank (46,080 bytes per token)" in four.describe()
    short = size_kv_cache(budget=KVBudget(4 * GiB, "test"), max_len=1024, bytes_per_token=per_token, max_batch_size=32)
    assert short.slots == 32  # capped by --max-batch-size


def test_a_budget_that_cannot_hold_one_full_sequence_is_refused_with_the_fix():
    per_token = kv_bytes_per_token(SMOLLM2, tp=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 8192 positions.*Fix: --kv-cache-memory 360MiB "
                                         r"or more, or a shorter --max-model-len \(at most 2275 positions fit\)"):
        size_kv_cache(budget=KVBudget(100 * 2**20, "--kv-cache-memory 100MiB"), max_len=8192,
                      bytes_per_token=per_token, max_batch_size=32)


def test_budget_flags():
    assert parse_bytes("4GiB") == 4 * GiB and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="--kv-cache-memory '4 potatoes' is not a size"):
        parse_bytes("4 potatoes")
    with pytest.raises(ValueError, match="both size the KV cache"):
        kv_budget(kv_cache_memory="1GiB", utilization=0.5, device_type="cpu", weights=0)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 1.5 must be a fraction"):
        kv_budget(kv_cache_memory=None, utilization=1.5, device_type="cpu", weights=0)
    cpu = kv_budget(kv_cache_memory=None, utilization=None, device_type="cpu", weights=10**9)
    assert 0 < cpu.bytes <= 4 * GiB and "CPU default" in cpu.source
    assert kv_budget(kv_cache_memory="3GiB", utilization=None, device_type="cpu", weights=0).bytes == 3 * GiB
