"""Reliability matrix 3, the Hugging Face directory rows (F2, F3, F5, F7, F8, F13, F16, F17, F19):
a config.json or weights that lie are one line naming the file and field, before any model is
built. Before: 10^6 layers built a meta model for minutes (F2), `rope_theta` 0 or NaN and NaN
weights generated garbage with exit 0 (F7, F16), and several fields were raw tracebacks."""

from __future__ import annotations

import json
import time

import pytest
from safetensors.torch import load_file, save_file

from dtmega.cli import main as dtmega_main
from tests.hf_models import save_tiny_deepseek_v3, save_tiny_llama31


def _edit(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    for field, value in fields.items():
        if value is ...:
            config.pop(field, None)
        else:
            config[field] = value
        if field == "rope_theta" and isinstance(config.get("rope_parameters"), dict):  # transformers 5's place
            config["rope_parameters"]["rope_theta"] = value
        if field == "rope_scaling":
            config.pop("rope_parameters", None)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _single_file(directory):
    """The tiny model's shards merged into one model.safetensors (the layout small models ship in)."""
    weights = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        weights.update(load_file(shard))
        shard.unlink()
    (directory / "model.safetensors.index.json").unlink()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _convert(hf, tmp_path, capsys) -> str:
    capsys.readouterr()
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(tmp_path / "ckpt")]) == 2
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("iter_*"))
    return capsys.readouterr().err


@pytest.mark.parametrize("fields, message", [
    ({"num_hidden_layers": 10**6}, r"num_hidden_layers \(n_layer\) is 1000000, but the shards hold layers 0..1 only"),  # F2
    ({"num_attention_heads": 0}, r"num_attention_heads must be positive, got 0"),  # F3
    ({"rms_norm_eps": "abc"}, r"rms_norm_eps = 'abc' is not a number"),  # F5
    ({"rope_theta": 0}, r"rope_theta must be a finite number above 0, got 0"),  # F7
    ({"rope_theta": float("nan")}, r"rope_theta must be a finite number above 0, got nan"),  # F7
    ({"rms_norm_eps": -1e-6}, r"norm_eps must be a finite number above 0"),
    ({"hidden_size": -64}, r"hidden_size must be positive, got -64"),  # F4 (held)
    ({"num_key_value_heads": 3}, r"n_heads=4 is not divisible by n_kv_heads=3"),  # F4 (held)
    ({"num_hidden_layers": "2"}, r"num_hidden_layers is missing or not an integer \('2'\)"),  # F4 (held)
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, r"rope_scaling.factor must be a finite number of at least 1"),
])
def test_a_llama_config_that_lies_is_one_line_before_any_model(tmp_path, capsys, fields, message):
    hf = _edit(save_tiny_llama31(tmp_path / "hf"), **fields)
    started = time.perf_counter()
    error = _convert(hf, tmp_path, capsys)
    assert time.perf_counter() - started < 60  # F2: no model of a million layers was built first
    assert "config.json" in error and __import__("re").search(message, error), error
    assert "Traceback" not in error


@pytest.mark.parametrize("fields, message", [
    ({"rope_scaling": {"type": "yarn", "factor": 0, "original_max_position_embeddings": 64, "beta_fast": 32,
                       "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
     r"yarn.factor must be a finite number of at least 1"),
    ({"kv_lora_rank": ...}, r"kv_lora_rank is missing"),  # F19
    ({"num_experts_per_tok": 10}, r"top_k=10 must be between 1 and num_experts"),  # F18 (held)
    ({"n_group": 3, "topk_group": 1}, r"not divisible by num_groups=3"),  # F18 (held)
    ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim=7 must be even"),  # F18 (held)
    ({"q_lora_rank": "abc"}, r"q_lora_rank = 'abc' is not an integer"),  # F19
])
def test_a_deepseek_config_that_lies_is_one_line(tmp_path, capsys, fields, message):
    hf = _edit(save_tiny_deepseek_v3(tmp_path / "hf"), **fields)
    error = _convert(hf, tmp_path, capsys)
    assert "config.json" in error and __import__("re").search(message, error), error


def test_an_index_whose_weight_map_is_a_list_is_named(tmp_path, capsys):
    """F13: a raw AttributeError before."""
    hf = save_tiny_llama31(tmp_path / "hf")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    assert "weight_map is a list, not an object" in _convert(hf, tmp_path, capsys)


def test_a_single_safetensors_file_with_a_lying_header_is_one_line(tmp_path, capsys):
    """F8: the single-file layout opened its header outside the one-line handling."""
    hf = _single_file(save_tiny_llama31(tmp_path / "hf"))
    data = bytearray((hf / "model.safetensors").read_bytes())
    data[:8] = (1 << 62).to_bytes(8, "little")
    (hf / "model.safetensors").write_bytes(bytes(data))
    assert "model.safetensors is not a readable safetensors file" in _convert(hf, tmp_path, capsys)


@pytest.mark.parametrize("name, poison", [("model.embed_tokens.weight", float("nan")), ("model.norm.weight", float("inf"))])
def test_non_finite_weights_are_refused_as_they_are_read(tmp_path, capsys, name, poison):
    """F16/F17: a NaN embedding or an inf in the final norm was converted (exit 0), generated
    garbage and made training "diverge"; now the tensor is named at load, by every command that
    reads the weights."""
    hf = _single_file(save_tiny_llama31(tmp_path / "hf"))
    weights = load_file(hf / "model.safetensors")
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = poison
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    error = _convert(hf, tmp_path, capsys)
    assert f"{name} holds 1 non-finite values (NaN or infinity)" in error, error
    assert dtmega_main(["generate", "--load-hf", str(hf), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert f"{name} holds 1 non-finite values" in capsys.readouterr().err


def test_f14_an_index_that_puts_a_tensor_in_config_json_is_named(tmp_path, capsys):
    """Matrix 3, F14 (held): the file named is read as safetensors and refused as not one."""
    hf = save_tiny_llama31(tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "config.json"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "config.json is not a readable safetensors file" in _convert(hf, tmp_path, capsys)
