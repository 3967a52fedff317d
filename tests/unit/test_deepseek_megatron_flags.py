"""Megatron's multi-latent-attention flags (issue 35): DeepSeek-V3's own launch flags, as
Megatron's DeepSeek-V3 scripts write them, build exactly dtmega's `deepseek-v3` (every size,
routing and YaRN setting; 671 B parameters); Megatron's defaults for flags left out; a small MLA
model from flags trains; and each flag that does not fit is one line naming it and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from dtmega.cli import main as dtmega_main
from dtmega.models.deepseek import DeepSeekConfig
from dtmega.train.args import parse_train_args
from dtmega.train.prepare import model_of
from tests.train_helpers import LLAMA_BLOCK

BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--seq-length", "32",
        "--train-iters", "2", "--lr", "1e-3"]

# DeepSeek-V3 (R1) as Megatron launch scripts describe it (--moe-layer-freq as the explicit list)
V3_FLAGS = [
    "--disable-bias-linear", "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
    "--num-attention-heads", "128", "--kv-channels", "128", "--normalization", "RMSNorm", "--position-embedding-type",
    "rope", "--norm-epsilon", "1e-6", "--swiglu", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--untie-embeddings-and-output-weights", "--vocab-size", "129280",
    "--make-vocab-size-divisible-by", "1", "--max-position-embeddings", "163840",
    "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
    "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm", "--rotary-scaling-factor", "40",
    "--rotary-base", "10000", "--mscale", "1.0", "--mscale-all-dim", "1.0", "--init-method-std", "0.006",
    "--num-experts", "256", "--moe-layer-freq", "[" + ", ".join(["0"] * 3 + ["1"] * 58) + "]",
    "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "8", "--moe-shared-expert-intermediate-size", "2048",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.0001",
    "--moe-router-group-topk", "4", "--moe-router-num-groups", "8", "--moe-router-topk-scaling-factor", "2.5",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
]


def test_deepseek_v3_launch_flags_build_the_named_model():
    args, _ = parse_train_args([*BASE, "--tokenizer-type", "NullTokenizer", *V3_FLAGS])
    spec, config = model_of(args, 129280)
    named = DeepSeekConfig.from_name("deepseek-v3")
    assert spec.family == "dtmega-deepseek"
    # the architecture equals the named size; the balancing settings are the launch's own
    assert config.replace(moe=named.moe) == named
    moe, expected = config.moe, named.moe
    assert (moe.num_experts, moe.top_k, moe.ffn_dim, moe.first_dense_layers, moe.shared_expert_ffn_dim,
            moe.score_func, moe.route_scale, moe.num_groups, moe.group_topk, moe.expert_bias) == (
        expected.num_experts, expected.top_k, expected.ffn_dim, expected.first_dense_layers,
        expected.shared_expert_ffn_dim, expected.score_func, expected.route_scale, expected.num_groups,
        expected.group_topk, expected.expert_bias)
    assert config.num_params() == named.num_params() == 671_026_404_352


def test_megatrons_defaults_fill_what_a_launch_leaves_out():
    """kv_lora_rank 32, qk-head-dim 128, qk-pos-emb-head-dim 64, v-head-dim 128, no query latent,
    no YaRN stretch at --rotary-scaling-factor 1 (Megatron's defaults)."""
    args, _ = parse_train_args([*BASE, "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
                                *LLAMA_BLOCK, "--multi-latent-attention", "--qk-layernorm"])
    _, config = model_of(args, 256)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim, config.yarn, config.moe, config.mtp_num_layers) == (None, 32, 128, 64, 128, None, None, 0)
    args, _ = parse_train_args([*BASE, "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
                                *LLAMA_BLOCK, "--multi-latent-attention", "--qk-layernorm", "--rotary-scaling-factor", "4",
                                "--mscale", "0.707", "--mscale-all-dim", "0.707", "--max-position-embeddings", "16384"])
    yarn = model_of(args, 256)[1].yarn
    assert dataclasses.astuple(yarn) == (4.0, 4096, 32.0, 1.0, 0.707, 0.707)


BAD = {
    "latent_flags_without_mla": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", *LLAMA_BLOCK,
                                  "--kv-lora-rank", "16"],
                                 "without --multi-latent-attention: these flags size multi-latent attention"),
    "mla_without_qk_layernorm": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", *LLAMA_BLOCK,
                                  "--multi-latent-attention"], "Fix: add --qk-layernorm"),
    "odd_rope_dim": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", *LLAMA_BLOCK,
                      "--multi-latent-attention", "--qk-layernorm", "--qk-pos-emb-head-dim", "7"],
                     "--qk-pos-emb-head-dim=7 must be even"),
    "stretch_with_plain_rope": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", *LLAMA_BLOCK,
                                 "--multi-latent-attention", "--qk-layernorm", "--rope-type", "rope",
                                 "--rotary-scaling-factor", "4"], "Fix: --rope-type yarn"),
    "preset_and_flags": (["--model", "deepseek-debug", "--multi-latent-attention", "--qk-layernorm"],
                         "the preset and the flags both size the model"),
    "group_topk_above_groups": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", *LLAMA_BLOCK,
                                 "--multi-latent-attention", "--qk-layernorm", "--num-experts", "8",
                                 "--moe-router-topk", "2", "--moe-router-num-groups", "4", "--moe-router-group-topk",
                                 "5"], "group_topk=5 must be between 1 and num_groups=4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_flags_that_do_not_fit_are_one_line_naming_the_fix(case, capsys):
    flags, message = BAD[case]
    assert dtmega_main(["train", *BASE, *flags, "--dry-run", "1"]) == 2
    assert message in capsys.readouterr().err


def test_a_small_mla_model_from_flags_plans_for_expert_parallelism(capsys):
    """A laptop-size MLA MoE from Megatron's flags: the dry run plans EP4 with group-limited
    routing (4 groups on 4 ranks) and one MTP depth."""
    flags = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", *LLAMA_BLOCK,
             "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "32", "--kv-lora-rank", "16",
             "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--num-experts", "8",
             "--moe-router-topk", "2", "--moe-layer-freq", "([0]*1+[1]*2)", "--moe-router-num-groups", "4",
             "--moe-router-group-topk", "2", "--moe-router-score-function", "sigmoid",
             "--moe-router-enable-expert-bias", "--mtp-num-layers", "1", "--expert-model-parallel-size", "4",
             "--global-batch-size", "4", "--micro-batch-size", "1"]
    assert dtmega_main(["train", *BASE, *flags, "--dry-run", "4"]) == 0
    out = capsys.readouterr().out
    assert "ep=4" in out, out[-2000:]
