"""The GPT family (dtmega/models/gpt/) against transformers' GPT2LMHeadModel and Megatron's flags.

- Every named size has exactly the parameters transformers' GPT2LMHeadModel of the same config
  has; GPT-3 175B is Megatron's example (51,200 padded vocabulary, 2,048 positions).
- A tiny random GPT-2 saved by transformers (random LayerNorm weights and biases, so a swapped
  weight/bias or an untransposed Conv1D shows) loads with `--load-hf`'s path: logits equal
  transformers' (fp32, 1e-5 relative: the same ops in another order); greedy generation with the
  KV cache token-identical to transformers' `generate` and to decoding without a cache; exported
  back, every tensor is bitwise the source's and transformers computes the same logits.
- Megatron's flags build what `pretrain_gpt.py` builds, with its defaults where a flag is absent.
- Dropout: masks are functions of (seed, site, global sample, position, feature), so a batch split
  into micro-batches or ranks draws the masks the whole batch draws, recompute replays them, and
  evaluation drops nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtmega.cli import main as dtmega_main
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.models import model_spec
from dtmega.models.gpt import GPT, GPT_SIZES
from dtmega.models.gpt.hf_config import gpt_config_from_hf, hf_config_from_gpt
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.train.generate import generate_tokens
from dtmega.train.restore import restore
from tests.hf_models import greedy_three_ways, save_tiny_gpt2, transformers_logits
from tests.unit.test_hf_checkpoints import assert_bitwise, hf_tensors, relative_max

LOGITS_RTOL = 1e-5
# GPT2LMHeadModel's count for each size's config.json (GPT-2's 50,257 tokens padded to 50,304 as
# Megatron pads them; GPT-3 175B with Megatron's example's 51,200)
COUNTS = {"gpt2-124m": 124_475_904, "gpt2-medium": 354_871_296, "gpt3-175b": 174_615_846_912}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "hf")


@pytest.mark.parametrize("name", list(COUNTS))
def test_named_sizes_have_transformers_parameter_counts(name):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT_SIZES[name]
    with torch.device("meta"):
        theirs = GPT2LMHeadModel(GPT2Config(**hf_config_from_gpt(config)))
        ours = GPT(config)
    count = sum(p.numel() for p in {id(p): p for p in theirs.parameters()}.values())
    assert config.num_params() == sum(p.numel() for p in {id(p): p for p in ours.parameters()}.values()) == count
    assert count == COUNTS[name] and model_spec(name).family == "dtmega-gpt"


def test_load_hf_logits_and_greedy_generation_equal_transformers(gpt2_dir):

    checkpoint = HFCheckpoint.open(gpt2_dir)
    assert checkpoint.model == "gpt" and checkpoint.config.tie_embeddings
    pm, _, state = restore(None, load_hf=gpt2_dir)
    assert state["model"] == "gpt" and isinstance(pm.module, GPT)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = pm.forward(ids)
    assert relative_max(ours, transformers_logits(gpt2_dir, ids)) < LOGITS_RTOL
    expected, cached, uncached = greedy_three_ways(gpt2_dir, pm.module, ids[0, :9].tolist(), checkpoint.config.vocab_size,
                                                   12)
    assert cached == expected == uncached


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_convert_both_ways_round_trips_and_transformers_reads_the_export(tie, gpt2_dir, tmp_path):
    source = gpt2_dir if tie else save_tiny_gpt2(tmp_path / "hf", seed=1, tie=False, activation="gelu")
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(source), "--save", str(tmp_path / "c")]) == 0
    state = json.loads((tmp_path / "c" / "iter_0000000" / "state.json").read_text())
    assert state["model"] == "gpt" and state["model_config"]["tie_embeddings"] == tie
    assert state["model_config"]["gelu_approximate"] == ("tanh" if tie else "none")
    assert dtmega_main(["convert", "dtmega-to-hf", "--load", str(tmp_path / "c"), "--hf-dir", str(tmp_path / "back")]) == 0
    assert_bitwise(hf_tensors(source), hf_tensors(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == ["GPT2LMHeadModel"]
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    assert relative_max(transformers_logits(tmp_path / "back", ids), transformers_logits(source, ids)) < 1e-6


@pytest.mark.parametrize("field, value, words", [
    ("activation_function", "relu", "activation_function = 'relu' is not supported"),
    ("add_cross_attention", True, "add_cross_attention = True is not supported"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx = True is not supported"),
    ("n_layer", 10**6, "n_layer = 1000000 is not supported"),
])
def test_a_gpt2_config_dtmega_does_not_compute_is_refused_by_name(gpt2_dir, field, value, words):
    config = json.loads((gpt2_dir / "config.json").read_text())
    with pytest.raises(HFFormatError, match=words):
        gpt_config_from_hf({**config, field: value})


def test_a_gpt_gpt2_cannot_hold_is_refused_on_export():
    with pytest.raises(HFFormatError, match=r"cannot hold this GPT: normalization='RMSNorm'"):
        hf_config_from_gpt(GPT_SIZES["gpt-debug"].replace(normalization="RMSNorm"))


# ---- Megatron's flags --------------------------------------------------------------------------
BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
LLAMA_BLOCK = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
               "--attention-dropout", "0", "--hidden-dropout", "0"]


def _model(argv):
    from dtmega.train.args import parse_train_args
    from dtmega.train.prepare import model_of

    return model_of(parse_train_args(argv)[0], tokenizer_vocab=250)


def test_a_line_without_block_flags_builds_megatrons_gpt_blocks():
    """pretrain_gpt.py's defaults: LayerNorm, learned positions, biases, a 4 x GeLU MLP (the fused
    bias-GeLU's tanh form), dropout 0.1, the output tied to the word embedding."""
    spec, config = _model(BASE)
    assert spec.name == "gpt" and spec.family == "dtmega-gpt"
    assert (config.normalization, config.position_embedding, config.bias, config.activation) == \
        ("LayerNorm", "learned_absolute", True, "gelu")
    assert (config.hidden_ffn, config.gelu_approximate, config.attention_dropout, config.hidden_dropout) == \
        (256, "tanh", 0.1, 0.1)
    assert config.tie_embeddings and config.max_seq_len == 32 and config.vocab_size == 256


@pytest.mark.parametrize("flags, field, value", [
    (["--no-bias-gelu-fusion"], "gelu_approximate", "none"),
    (["--squared-relu"], "activation", "squared_relu"),
    (["--swiglu"], "activation", "swiglu"),
    (["--normalization", "RMSNorm"], "normalization", "RMSNorm"),
    (["--apply-layernorm-1p"], "layernorm_1p", True),
    (["--position-embedding-type", "rope"], "position_embedding", "rope"),
    (["--position-embedding-type", "none"], "position_embedding", "none"),
    (["--disable-bias-linear"], "bias", False),
    (["--disable-bias-linear", "--add-qkv-bias"], "has_qkv_bias", True),
    (["--attention-dropout", "0.0", "--hidden-dropout", "0.2"], "hidden_dropout", 0.2),
    (["--untie-embeddings-and-output-weights"], "tie_embeddings", False),
    (["--qk-layernorm"], "qk_norm", True),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.5"], "rotary_dim", 8),
    ([*LLAMA_BLOCK, "--rotary-percent", "0.5"], "rotary_percent", 0.5),  # a Llama block with partial rotary: GPT blocks
])
def test_each_block_flag_reaches_the_gpt_config(flags, field, value):
    spec, config = _model([*BASE, *flags])
    assert spec.family == "dtmega-gpt" and getattr(config, field) == value


def test_the_llama_block_flags_build_dtmegas_llama():
    spec, config = _model([*BASE, *LLAMA_BLOCK])
    assert spec.family == "dtmega-llama"


def test_qk_layernorm_is_qwen3_on_llama_blocks_and_the_gpt_blocks_own_norms_otherwise():
    """Megatron's --qk-layernorm norms each query and key head with the block's norm kind: on a
    Llama block that is Qwen3's attention; on GPT blocks a LayerNorm with weight and bias over the
    head width, counted as Megatron counts it (2 x 2 x head_dim per block)."""
    spec, _ = _model([*BASE, *LLAMA_BLOCK, "--qk-layernorm"])
    assert spec.name == "qwen3"
    spec, config = _model([*BASE, "--qk-layernorm"])
    plain = _model(BASE)[1]
    model = spec.build(config)
    assert spec.family == "dtmega-gpt" and type(model.layers["0"].attention.k_norm).__name__ == "LayerNorm"
    assert config.num_params() - plain.num_params() == 2 * 2 * 2 * config.head_dim
    assert config.num_params() == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with pytest.raises(HFFormatError, match="qk_norm=True"):
        hf_config_from_gpt(config)


@pytest.mark.parametrize("flags", [
    ["--apply-layernorm-1p"], ["--normalization", "RMSNorm", "--apply-layernorm-1p"],
    ["--position-embedding-type", "rope", "--squared-relu", "--disable-bias-linear", "--add-qkv-bias"],
    ["--qk-layernorm", "--position-embedding-type", "rope", "--apply-layernorm-1p"],
    ["--position-embedding-type", "rope", "--rotary-percent", "0.5"],
])
def test_gpt_variants_run_forward_and_backward(flags):
    spec, config = _model([*BASE, *flags])
    model = spec.build(config)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 250, (2, 16))
    model(tokens).float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- dropout ----------------------------------------------------------------------------------
def _model_with_dropout(p=0.2, seed=0, **overrides) -> GPT:
    model = GPT(GPT_SIZES["gpt-debug"].replace(attention_dropout=p, hidden_dropout=p, **overrides))
    model.init_weights(seed=seed)
    return model


def test_dropout_drops_in_training_only_and_at_its_rate():
    model = _model_with_dropout(0.3)
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        evaluated, again = model(tokens), model(tokens)
    assert torch.equal(evaluated, again)
    model.train()
    trained = model(tokens, sample_ids=torch.arange(4))
    assert not torch.allclose(trained, evaluated, atol=1e-3)
    # the drop rate of one site's masks over 4 x 64 x 64 elements: 0.3 within 4 standard deviations
    from dtmega.models.gpt.dropout import feature_mask, token_keys

    keys = token_keys(0, torch.arange(4), torch.arange(64)[None])
    dropped = 1 - feature_mask(keys, 12345, 64, 0.3).float().mean().item()
    assert abs(dropped - 0.3) < 4 * (0.3 * 0.7 / (4 * 64 * 64)) ** 0.5


def test_masks_follow_the_sample_not_the_batch_split():
    """One forward of 4 samples equals two of 2 (the second told its samples are 2 and 3), and a
    model counting its samples itself (as micro-batches do) draws the same: loss and gradients."""
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    whole = _model_with_dropout()
    whole.train()
    whole(tokens, sample_ids=torch.arange(4)).float().square().mean().backward()
    halves = _model_with_dropout()
    halves.train()
    loss = sum(halves(tokens[i:i + 2]).float().square().mean() / 2 for i in (0, 2))  # counted: 0-1, then 2-3
    loss.backward()
    for (name, a), b in zip(whole.named_parameters(), halves.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name


def test_data_parallel_ranks_draw_the_whole_batchs_masks():
    """Rank r of 2 holding samples 2r, 2r + 1 of each 4-sample micro-step (Megatron's sampler)."""
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    whole = _model_with_dropout()
    whole.train()
    expected = whole(tokens)
    for rank in (0, 1):
        replica = _model_with_dropout()
        replica.train()
        replica.set_data_parallel_rank(rank, 2)
        assert torch.equal(replica(tokens[2 * rank:2 * rank + 2]), expected[2 * rank:2 * rank + 2])


def test_recompute_replays_the_masks():
    from torch.utils.checkpoint import checkpoint

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    plain, recomputed = _model_with_dropout(), _model_with_dropout()
    for block in recomputed.layers.values():
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    for model in (plain, recomputed):
        model.train()
        model(tokens, sample_ids=torch.arange(2)).float().square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_generation_drops_nothing():
    model = _model_with_dropout(0.5)
    model.train()  # generate_tokens evaluates whatever mode the caller left
    first = generate_tokens(model, [1, 2, 3], vocab_size=256, eod=None, max_new_tokens=6, temperature=0.0).ids
    second = generate_tokens(model, [1, 2, 3], vocab_size=256, eod=None, max_new_tokens=6, temperature=0.0).ids
    assert first == second
