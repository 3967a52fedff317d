"""Qwen3 (dtmega/models/qwen3/) against transformers' Qwen3ForCausalLM, the ground truth.

- Every named size has exactly the parameters transformers' model of the same config.json has
  (built on the meta device from the config dtmega writes for it).
- A tiny random Qwen3 saved by transformers (head_dim independent of the width, tied, random
  q/k-norm weights) loads with `--load-hf`'s path: logits equal transformers' (fp32, 1e-5 relative:
  the same ops in another order, RoPE in pairs instead of halves); greedy generation with the KV
  cache token-identical to transformers' `generate` and to decoding without a cache; exported back
  (the commands), every tensor is bitwise the source's and transformers computes the same logits.
- Megatron's --qk-layernorm and --kv-channels size a Qwen3 (both refused before this family).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtmega.cli import main as dtmega_main
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.models import model_spec
from dtmega.models.qwen3 import QWEN3_SIZES, Qwen3
from dtmega.models.qwen3.hf_config import hf_config_from_qwen3, qwen3_config_from_hf
from dtmega.train.restore import restore
from tests.hf_models import greedy_three_ways, save_tiny_qwen3, transformers_logits
from tests.unit.test_hf_checkpoints import assert_bitwise, hf_tensors, relative_max

LOGITS_RTOL = 1e-5

# The published totals (Qwen's model cards round them; these are the exact counts of their configs)
PUBLISHED_BILLIONS = {"qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-14b": 14.8,
                      "qwen3-32b": 32.8}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "hf")


@pytest.mark.parametrize("name", list(PUBLISHED_BILLIONS))
def test_named_sizes_have_transformers_parameter_counts(name):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = QWEN3_SIZES[name]
    hf = hf_config_from_qwen3(config)
    with torch.device("meta"):
        theirs = Qwen3ForCausalLM(Qwen3Config(**hf))
        ours = Qwen3(config)
    count = sum(p.numel() for p in {id(p): p for p in theirs.parameters()}.values())
    assert config.num_params() == sum(p.numel() for p in {id(p): p for p in ours.parameters()}.values()) == count
    assert round(count / 1e9, 1) == PUBLISHED_BILLIONS[name]
    assert model_spec(name).family == "dtmega-qwen3" and qwen3_config_from_hf(hf) == config


def test_load_hf_logits_and_greedy_generation_equal_transformers(qwen3_dir):

    checkpoint = HFCheckpoint.open(qwen3_dir)
    assert checkpoint.model == "qwen3" and checkpoint.config.head_dim == 32 and checkpoint.config.tie_embeddings
    pm, _, state = restore(None, load_hf=qwen3_dir)
    assert state["model"] == "qwen3" and isinstance(pm.module, Qwen3)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = pm.forward(ids)
    assert relative_max(ours, transformers_logits(qwen3_dir, ids)) < LOGITS_RTOL
    expected, cached, uncached = greedy_three_ways(qwen3_dir, pm.module, ids[0, :9].tolist(), checkpoint.config.vocab_size,
                                                   12)
    assert cached == expected == uncached


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_convert_both_ways_round_trips_and_transformers_reads_the_export(tie, qwen3_dir, tmp_path):
    source = qwen3_dir if tie else save_tiny_qwen3(tmp_path / "hf", seed=1, tie=False)
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(source), "--save", str(tmp_path / "c")]) == 0
    state = json.loads((tmp_path / "c" / "iter_0000000" / "state.json").read_text())
    assert state["model"] == "qwen3" and state["model_config"]["qk_norm"] and state["model_config"]["kv_channels"] == 32
    assert dtmega_main(["convert", "dtmega-to-hf", "--load", str(tmp_path / "c"), "--hf-dir", str(tmp_path / "back")]) == 0
    assert_bitwise(hf_tensors(source), hf_tensors(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForCausalLM"] and written["head_dim"] == 32
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    assert relative_max(transformers_logits(tmp_path / "back", ids), transformers_logits(source, ids)) < 1e-6


def test_a_sliding_window_qwen3_is_refused_by_name(qwen3_dir, tmp_path):
    from dtmega.models.llama.hf_config import HFFormatError

    config = json.loads((qwen3_dir / "config.json").read_text())
    with pytest.raises(HFFormatError, match="use_sliding_window = True.*Fix: a config with use_sliding_window false"):
        qwen3_config_from_hf({**config, "use_sliding_window": True, "sliding_window": 64})


MEGATRON_QWEN3 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
                  "--num-query-groups", "2", "--kv-channels", "32", "--qk-layernorm", "--ffn-hidden-size", "96",
                  "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
                  "--attention-dropout", "0", "--hidden-dropout", "0",
                  "--rotary-base", "1000000", "--seq-length", "32", "--max-position-embeddings", "64"]


def test_megatron_flags_size_a_qwen3():
    """Megatron's Qwen3 flags (--qk-layernorm, --kv-channels 128 at full size) build dtmega's
    Qwen3 with the head width they give; without --qk-layernorm --kv-channels sizes a Llama."""
    from dtmega.train.args import parse_train_args
    from dtmega.train.prepare import model_of

    spec, config = model_of(parse_train_args(["--mock-data", *MEGATRON_QWEN3])[0], tokenizer_vocab=250)
    assert spec.name == "qwen3" and spec.family == "dtmega-qwen3"
    assert config.qk_norm and config.head_dim == 32 and config.n_heads * config.head_dim == 128 != config.dim
    llama_flags = [flag for flag in MEGATRON_QWEN3 if flag != "--qk-layernorm"]
    spec, config = model_of(parse_train_args(["--mock-data", *llama_flags])[0], tokenizer_vocab=250)
    assert spec.family == "dtmega-llama" and not config.qk_norm and config.head_dim == 32


def test_a_named_llama_size_with_qk_layernorm_is_refused_by_name():
    from dtmega.train.args import ArgumentError, parse_train_args
    from dtmega.train.prepare import model_of

    with pytest.raises(ArgumentError, match=r"--model llama3-8b is a dtmega-llama model; --qk-layernorm builds a "
                                            r"dtmega-qwen3 model\. Fix"):
        model_of(parse_train_args(["--mock-data", "--model", "llama3-8b", "--qk-layernorm", "--seq-length", "32"])[0],
                 250)
