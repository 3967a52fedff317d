"""DeepSeek-V3 Hugging Face checkpoints as files (issue 35 item 5): a tiny random
`DeepseekV3ForCausalLM` saved by transformers' own `save_pretrained` is read by `--load-hf`'s
path (the sharded reader; `restore`) and by `dtmega convert hf-to-dtmega`, and written back by
`dtmega-to-hf`; DeepSeek's FP8 block-quantized format is dequantized as it is read; MTP layers
(DeepSeek's `model.layers.{n}` after the last block) are read and written.

Tolerances: logits within 1e-5 relative (fp32, max |difference| / max |logit|): the same math
summed in another order (~3e-7 in practice). Tensors moved without arithmetic (conversion,
export, the MTP layers) are compared bitwise; the FP8 load is compared bitwise with the
dequantization rule written independently in tests/hf_models.py (weight x its tile's scale).
The sharded plans are in tests/distributed/test_deepseek_hf_files.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dtmega.cli import main as dtmega_main
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.models.deepseek import DeepSeek, DeepSeekConfig
from dtmega.models.deepseek.hf_config import hf_config_from_deepseek
from dtmega.models.deepseek.hf_names import dtmega_state_from_hf, hf_state_from_dtmega
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.train.generate import generate_tokens
from dtmega.train.restore import restore
from tests.hf_models import (
    dequantized_fp8,
    greedy_three_ways,
    quantize_fp8_blocks,
    save_tiny_deepseek_v3,
    transformers_logits,
)
from tests.unit.test_hf_checkpoints import assert_bitwise, hf_tensors, relative_max

LOGITS_RTOL = 1e-5


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    return save_tiny_deepseek_v3(tmp_path_factory.mktemp("deepseek") / "hf")


@pytest.fixture(scope="module")
def fp8_dir(deepseek_dir, tmp_path_factory) -> Path:
    return quantize_fp8_blocks(deepseek_dir, tmp_path_factory.mktemp("deepseek_fp8") / "hf")


@pytest.mark.parametrize("interleave", [True, False], ids=["rope_interleave", "rope_half_split"])
def test_load_hf_logits_and_greedy_generation_equal_transformers(interleave, deepseek_dir, tmp_path):
    """`--load-hf`'s path (restore on one rank): logits equal transformers' for both RoPE
    layouts; greedy generation token-identical to transformers' `generate`, with the latent KV
    cache and without any cache; the note says the file holds no MTP layer."""

    directory = deepseek_dir if interleave else save_tiny_deepseek_v3(tmp_path / "hf", rope_interleave=False)
    checkpoint = HFCheckpoint.open(directory)
    assert checkpoint.model == "deepseek-v3" and checkpoint.config.mtp_num_layers == 0
    assert "holds no multi-token-prediction layer" in checkpoint.notes[0]
    pm, tokenizer, state = restore(None, load_hf=directory)
    assert state["model"] == "deepseek-v3" and isinstance(pm.module, DeepSeek)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = pm.forward(ids)
    assert relative_max(ours, transformers_logits(directory, ids)) < LOGITS_RTOL
    expected, cached, uncached = greedy_three_ways(directory, pm.module, ids[0, :9].tolist(), checkpoint.config.vocab_size,
                                                   10)
    assert cached == expected == uncached


def test_generate_command_takes_a_deepseek_directory(deepseek_dir, capsys):
    """`dtmega generate --load-hf` decodes DeepSeek with the latent cache and says what it costs:
    3 blocks x (16 + 8) fp32 values per token, against 3 x 4 heads x (24 + 12) per-head."""
    assert dtmega_main(["generate", "--load-hf", str(deepseek_dir), "--prompt", "In the beginning", "--greedy",
                        "--max-new-tokens", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "In the beginning" in out
    assert (f"KV cache: {3 * 24 * 4:,} bytes per token on each rank (multi-latent attention: the latent and the "
            f"rotary key; per-head keys and values would take {3 * 4 * 36 * 4:,}, 6.0x)") in out


def test_the_serving_engine_decodes_deepseek_with_the_latent_cache(deepseek_dir):
    """`dtmega serve`'s engine (slots decoded together) on the DeepSeek directory: the tokens
    one-at-a-time greedy decoding gives, and a cache of exactly slots x length x the latent's
    bytes per token."""
    import threading

    from dtmega.serve.engine import Engine, Sampling, SequenceRequest, wait_all
    from dtmega.serve.kv_budget import kv_bytes_per_token

    pm, tokenizer, _ = restore(None, load_hf=deepseek_dir)
    model = pm.module.eval()
    engine = Engine(model, vocab_size=tokenizer.vocab_size, slots=4, max_len=48, decode_text=lambda ids: "")
    engine.reserve()
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 5)]
        results = wait_all(engine, [SequenceRequest(i, p, Sampling(max_new_tokens=8, temperature=0.0))
                                    for i, p in enumerate(prompts)], timeout=60)
    finally:
        engine.stop()
        thread.join(timeout=30)
    config = HFCheckpoint.open(deepseek_dir).config
    for prompt, result in zip(prompts, results):
        alone = generate_tokens(model, prompt, vocab_size=tokenizer.vocab_size, eod=None, max_new_tokens=8,
                                temperature=0.0)
        assert result.ids == alone.ids
    assert engine.cache_bytes() == 4 * 48 * kv_bytes_per_token(config, 1, torch.float32)


def test_convert_both_ways_round_trips_and_transformers_reads_the_export(deepseek_dir, tmp_path):
    """hf-to-dtmega then dtmega-to-hf (the commands): every tensor bitwise the source's, and
    transformers computes the source's logits from the export."""
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(deepseek_dir), "--save", str(tmp_path / "c")]) == 0
    state = json.loads((tmp_path / "c" / "iter_0000000" / "state.json").read_text())
    assert state["model"] == "deepseek-v3" and state["model_config"]["kv_lora_rank"] == 16
    assert dtmega_main(["convert", "dtmega-to-hf", "--load", str(tmp_path / "c"), "--hf-dir", str(tmp_path / "back")]) == 0
    assert_bitwise(hf_tensors(deepseek_dir), hf_tensors(tmp_path / "back"))
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    assert relative_max(transformers_logits(tmp_path / "back", ids), transformers_logits(deepseek_dir, ids)) < 1e-6


def test_half_split_rope_exports_in_pairs_with_the_same_logits(tmp_path):
    """A `rope_interleave=False` source is exported in DeepSeek's paired layout
    (`rope_interleave=True`): different rows, the same function."""
    from dtmega.interop.hf_export import export_hf
    from dtmega.interop.hf_import import import_hf

    source = save_tiny_deepseek_v3(tmp_path / "hf", seed=1, rope_interleave=False)
    export_hf(import_hf(source, tmp_path / "c"), tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_interleave"] is True
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(4))
    assert relative_max(transformers_logits(tmp_path / "back", ids), transformers_logits(source, ids)) < LOGITS_RTOL


def test_fp8_block_quantized_weights_are_dequantized_on_load(fp8_dir, tmp_path):
    """DeepSeek-V3's own format (float8_e4m3 linear weights, a float32 `weight_scale_inv` per
    16 x 16 tile here, so tiles straddle the tiny model's edges): every dtmega tensor equals
    the dequantized weights bitwise; the logits equal transformers' on the dequantized
    checkpoint; the export is plain float32 without `quantization_config`, and transformers
    reads it."""
    reference = dequantized_fp8(fp8_dir)
    plain = tmp_path / "dequantized"
    plain.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in reference.items()}, str(plain / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp8_dir / name, plain / name)
    checkpoint = HFCheckpoint.open(fp8_dir)
    assert checkpoint.block == (16, 16)
    assert checkpoint.dtypes["model.layers.1.self_attn.q_b_proj.weight"] == torch.float8_e4m3fn
    pm, _, _ = restore(None, load_hf=fp8_dir)
    expected = dtmega_state_from_hf(reference, checkpoint.config)
    for name, tensor in pm.module.state_dict().items():
        assert torch.equal(tensor, expected[name].float()), name
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_max(pm.forward(ids), transformers_logits(plain, ids)) < LOGITS_RTOL
    from dtmega.interop.hf_export import export_hf
    from dtmega.interop.hf_import import import_hf

    export_hf(import_hf(fp8_dir, tmp_path / "c"), tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in written and written["dtype"] == "float32"
    assert relative_max(transformers_logits(tmp_path / "back", ids), transformers_logits(plain, ids)) < 1e-6


def test_mtp_layers_are_read_and_written_as_deepseek_stores_them(tmp_path):
    """A model with one MTP depth written in DeepSeek's layout (layer n_layers: enorm, hnorm,
    eh_proj, a decoder layer, shared_head.norm, and copies of the embedding and output layer)
    loads back bitwise, and the conversion round trip writes the same files."""
    config = DeepSeekConfig.from_name("deepseek-debug", mtp_num_layers=1, vocab_size=320)
    with torch.device("meta"):
        model = DeepSeek(config)
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    tensors = hf_state_from_dtmega(model.state_dict(), config)
    layer = f"model.layers.{config.n_layers}."
    for name in ("embed_tokens.weight", "shared_head.head.weight", "shared_head.norm.weight", "eh_proj.weight",
                 "enorm.weight", "hnorm.weight", "self_attn.kv_b_proj.weight", "input_layernorm.weight"):
        assert layer + name in tensors, name
    assert torch.equal(tensors[layer + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    source = tmp_path / "hf"
    source.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(source / "model.safetensors"))
    (source / "config.json").write_text(json.dumps(hf_config_from_deepseek(config)))
    shutil.copy(save_tiny_deepseek_v3(tmp_path / "tokenizer_source") / "tokenizer.json", source / "tokenizer.json")
    checkpoint = HFCheckpoint.open(source)
    assert checkpoint.config.mtp_num_layers == 1 and not checkpoint.notes
    with torch.device("meta"):
        loaded = DeepSeek(checkpoint.config)
    loaded.to_empty(device="cpu")
    loaded.init_buffers(torch.device("cpu")) if hasattr(loaded, "init_buffers") else None
    checkpoint.load_into(loaded)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    from dtmega.interop.hf_export import export_hf
    from dtmega.interop.hf_import import import_hf

    export_hf(import_hf(source, tmp_path / "c"), tmp_path / "back")
    assert_bitwise(hf_tensors(source), hf_tensors(tmp_path / "back"))


def _break_scale(directory: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(directory / "model.safetensors"))


def _drop_scale(directory: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"]
    save_file(tensors, str(directory / "model.safetensors"))


def _config_edit(**changes):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    return edit


BAD_FP8 = {
    "scale_missing": (_drop_scale, r"experts.5.up_proj.weight is fp8 but the shards hold no .*weight_scale_inv"),
    "scale_wrong_shape": (_break_scale, r"o_proj.weight_scale_inv: \[1, 1\], one scale per 16 x 16 block"),
    "other_quantization": (_config_edit(quantization_config={"quant_method": "gptq", "bits": 4}),
                           r"quantization_config 'gptq'.*is not read by dtmega.*Fix: a bf16/fp32 checkpoint"),
    "fp8_without_quantization_config": (_config_edit(quantization_config=None),
                                        r"is F8_E4M3; dtmega reads F32, F16, BF16 and F64 weights, and F8_E4M3 ones "
                                        r"with block scales"),
}


@pytest.mark.parametrize("case", list(BAD_FP8))
def test_bad_fp8_checkpoints_are_refused_with_the_fix(case, fp8_dir, tmp_path, capsys):
    directory = tmp_path / "hf"
    shutil.copytree(fp8_dir, directory)
    damage, message = BAD_FP8[case]
    damage(directory)
    with pytest.raises(HFFormatError, match=message):
        HFCheckpoint.open(directory)
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(directory), "--save", str(tmp_path / "c")]) == 2
    assert not (tmp_path / "c").exists()


def test_train_load_hf_refuses_mtp_layers_the_checkpoint_lacks(deepseek_dir, capsys):
    """--mtp-num-layers cannot add depths to a --load-hf model (they would start from no
    weights); the refusal comes before launch."""
    base = ["train", "--load-hf", str(deepseek_dir), "--mock-data", "--seq-length", "16", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4"]
    assert dtmega_main([*base, "--mtp-num-layers", "1", "--dry-run", "1"]) == 2
    assert "holds 0 multi-token-prediction layers; --mtp-num-layers 1 would start some from no weights" in \
        capsys.readouterr().err
    assert dtmega_main([*base, "--expert-model-parallel-size", "2", "--dry-run", "4"]) == 0


KIMI_K2_SHAPE = dict(n_group=1, topk_group=1, n_routed_experts=12, num_experts_per_tok=2, routed_scaling_factor=2.827,
                     first_k_dense_replace=1, rope_parameters={
                         "rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                         "original_max_position_embeddings": 64, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0})


def test_kimi_k2_is_a_named_deepseek_size_at_transformers_count_and_its_shape_equals_transformers(tmp_path):
    """Kimi-K2 (issue 52, item 3): `--model kimi-k2` holds its published config.json's numbers,
    whose DeepseekV3ForCausalLM built by transformers (meta device) has exactly dtmega's
    1,026,408,209,408 parameters ("1T total, 32B activated"); a tiny Kimi-K2-shaped checkpoint
    (one expert group, 2.827 scaling, YaRN with beta_fast = beta_slow = 1, RoPE base 50,000, a
    dense first block) loads with logits equal to transformers' (fp32, 1e-5) and generates the
    same greedy tokens, with the latent cache and without."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from dtmega.models import model_spec

    kimi = DeepSeekConfig.from_name("kimi-k2")
    with torch.device("meta"):
        theirs = DeepseekV3ForCausalLM(DeepseekV3Config(**hf_config_from_deepseek(kimi)))
    assert kimi.num_params() == sum(p.numel() for p in theirs.parameters()) == 1_026_408_209_408
    assert round(kimi.num_active_params() / 1e9) == 33 and model_spec("kimi-k2").family == "dtmega-deepseek"
    assert kimi.moe.num_groups is None and kimi.moe.num_experts == 384 and kimi.n_heads == 64
    directory = save_tiny_deepseek_v3(tmp_path / "hf", seed=3, **KIMI_K2_SHAPE)
    checkpoint = HFCheckpoint.open(directory)
    assert checkpoint.config.moe.num_groups is None and checkpoint.config.moe.route_scale == 2.827
    pm, _, _ = restore(None, load_hf=directory)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = pm.forward(ids)
    assert relative_max(ours, transformers_logits(directory, ids)) < LOGITS_RTOL
    expected, cached, uncached = greedy_three_ways(directory, pm.module, ids[0, :9].tolist(),
                                                   checkpoint.config.vocab_size, 10)
    assert cached == expected == uncached
