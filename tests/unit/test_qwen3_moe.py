"""Qwen3-MoE (dtmega/models/qwen3_moe/) against transformers' Qwen3MoeForCausalLM, the ground truth.

- Each named size has exactly the parameters transformers' model of the same config.json has
  (built on the meta device from the config dtmega writes), and the published totals.
- A tiny random Qwen3-MoE saved by transformers (head_dim apart from the width, a dense first
  block, 8 experts top-2, random router and norms) loads with `--load-hf`'s path: logits equal
  transformers' (fp32, 1e-5 relative: the same ops in another order, RoPE in pairs instead of
  halves, experts summed in another order), with `norm_topk_prob` true and false; greedy generation
  with the KV cache token-identical to transformers' `generate` and to decoding without a cache;
  exported back (the commands), every tensor is bitwise the source's and transformers computes
  the same logits.
- Megatron's --qk-layernorm with --num-experts sizes a Qwen3-MoE.
- Configs dtmega's Qwen3-MoE does not compute are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtmega.cli import main as dtmega_main
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.models import model_spec
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.qwen3_moe import QWEN3_MOE_SIZES, Qwen3Moe
from dtmega.models.qwen3_moe.hf_config import hf_config_from_qwen3_moe, qwen3_moe_config_from_hf
from dtmega.train.restore import restore
from tests.hf_models import greedy_three_ways, save_tiny_qwen3_moe, transformers_logits
from tests.unit.test_hf_checkpoints import assert_bitwise, hf_tensors, relative_max

LOGITS_RTOL = 1e-5

# (total, active) in billions as Qwen's model cards give them (30.5B / 3.3B; 235B / 22B)
PUBLISHED = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0)}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "hf")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_named_sizes_have_transformers_parameter_counts(name):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = QWEN3_MOE_SIZES[name]
    hf = hf_config_from_qwen3_moe(config)
    with torch.device("meta"):
        theirs = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf))
        ours = Qwen3Moe(config)
    count = sum(p.numel() for p in theirs.parameters())
    assert config.num_params() == sum(p.numel() for p in ours.parameters()) == count
    total, active = PUBLISHED[name]
    assert abs(count / 1e9 - total) < 0.1 and abs(config.num_active_params() / 1e9 - active) < 0.2
    assert model_spec(name).family == "dtmega-qwen3-moe" and qwen3_moe_config_from_hf(hf) == config


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normalized_top_k", "raw_top_k"])
def test_load_hf_logits_and_greedy_generation_equal_transformers(norm_topk_prob, moe_dir, tmp_path):
    directory = moe_dir if norm_topk_prob else save_tiny_qwen3_moe(tmp_path / "hf", seed=1, norm_topk_prob=False)
    checkpoint = HFCheckpoint.open(directory)
    config = checkpoint.config
    assert checkpoint.model == "qwen3-moe" and config.head_dim == 32 and config.moe.first_dense_layers == 1
    assert config.moe.pre_softmax is (not norm_topk_prob)
    pm, _, state = restore(None, load_hf=directory)
    assert state["model"] == "qwen3-moe" and isinstance(pm.module, Qwen3Moe)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = pm.forward(ids)
    assert relative_max(ours, transformers_logits(directory, ids)) < LOGITS_RTOL
    expected, cached, uncached = greedy_three_ways(directory, pm.module, ids[0, :9].tolist(), config.vocab_size, 12)
    assert cached == expected == uncached


def test_convert_both_ways_round_trips_and_transformers_reads_the_export(moe_dir, tmp_path):
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(moe_dir), "--save", str(tmp_path / "c")]) == 0
    state = json.loads((tmp_path / "c" / "iter_0000000" / "state.json").read_text())
    assert state["model"] == "qwen3-moe" and state["model_config"]["moe"]["num_experts"] == 8
    assert dtmega_main(["convert", "dtmega-to-hf", "--load", str(tmp_path / "c"), "--hf-dir", str(tmp_path / "back")]) == 0
    assert_bitwise(hf_tensors(moe_dir), hf_tensors(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    source = json.loads((moe_dir / "config.json").read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    for field in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                  "decoder_sparse_step", "router_aux_loss_coef", "head_dim"):
        assert written[field] == source[field], field
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    assert relative_max(transformers_logits(tmp_path / "back", ids), transformers_logits(moe_dir, ids)) < 1e-6


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [2]}, r"MoE blocks \[0, 1\] .* are not dtmega's pattern"),
    ({"use_sliding_window": True, "sliding_window": 64}, r"use_sliding_window = True"),
    ({"num_experts_per_tok": 9}, r"top_k=9 must be between 1 and num_experts=8"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok = 0 must be a positive integer"),
    ({"moe_intermediate_size": None}, r"moe_intermediate_size is missing"),
    ({"attention_bias": True}, r"attention_bias = True is not supported"),
    ({"mlp_only_layers": [0, 1, 2]}, r"no block is MoE .* Fix: a Qwen3ForCausalLM config"),
])
def test_configs_it_does_not_compute_are_refused_by_name(moe_dir, change, message):
    config = json.loads((moe_dir / "config.json").read_text())
    with pytest.raises(HFFormatError, match=message):
        qwen3_moe_config_from_hf({**config, **change})


MEGATRON_QWEN3_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32", "--qk-layernorm",
                      "--ffn-hidden-size", "96", "--num-experts", "8", "--moe-router-topk", "2",
                      "--moe-ffn-hidden-size", "24", "--moe-aux-loss-coeff", "1e-3", "--swiglu", "--normalization",
                      "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear", "--attention-dropout",
                      "0", "--hidden-dropout", "0", "--rotary-base", "1000000", "--seq-length", "32",
                      "--max-position-embeddings", "64"]


def test_megatron_flags_size_a_qwen3_moe():
    """Megatron's Qwen3-MoE lines (--qk-layernorm with --num-experts) build dtmega's Qwen3-MoE;
    without --num-experts the same flags build a dense Qwen3."""
    from dtmega.train.args import parse_train_args
    from dtmega.train.prepare import model_of

    spec, config = model_of(parse_train_args(["--mock-data", *MEGATRON_QWEN3_MOE])[0], tokenizer_vocab=250)
    assert spec.name == "qwen3-moe" and spec.family == "dtmega-qwen3-moe"
    assert config.qk_norm and config.moe.num_experts == 8 and config.moe.ffn_dim == 24 and config.head_dim == 32
    dense = [f for f in MEGATRON_QWEN3_MOE]
    for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-aux-loss-coeff"):
        at = dense.index(flag)
        del dense[at:at + 2]
    spec, config = model_of(parse_train_args(["--mock-data", *dense])[0], tokenizer_vocab=250)
    assert spec.family == "dtmega-qwen3" and config.moe is None


def test_a_dense_config_is_refused_by_the_moe_class():
    from dtmega.kernels.errors import DtmegaError

    with pytest.raises(DtmegaError, match="Qwen3-MoE has experts"):
        Qwen3Moe(QWEN3_MOE_SIZES["qwen3-moe-debug"].replace(moe=None))


def test_a_config_without_norm_topk_prob_routes_as_transformers_default():
    """transformers' Qwen3MoeConfig defaults norm_topk_prob to False (the published configs say
    true): a config.json without the field is read with raw top-k probabilities, as transformers
    computes it."""
    from transformers import Qwen3MoeConfig

    config = hf_config_from_qwen3_moe(QWEN3_MOE_SIZES["qwen3-moe-debug"])
    del config["norm_topk_prob"]
    assert Qwen3MoeConfig(**config).norm_topk_prob is False
    assert qwen3_moe_config_from_hf(config).moe.pre_softmax is True
