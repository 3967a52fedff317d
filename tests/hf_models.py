"""Tiny Hugging Face models saved by transformers itself (random weights, fp32 safetensors),
with a small BPE tokenizer: the checkpoint tests' Llama-3.1 (RoPE scaling, GQA, untied output)
and Mixtral."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtmega.data.tokenizers import train_bpe
from tests.corpus import make_texts

VOCAB = 320  # the tokenizer below has 300 tokens: the embedding has spare rows, as real models do


def _tokenizer(directory: Path) -> None:
    train_bpe(make_texts(60, seed=5), 300, directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))


def save_tiny_llama31(directory: Path, seed: int = 0) -> Path:
    """A 2-block LlamaForCausalLM with Llama-3.1 RoPE scaling, GQA (4 heads / 2 KV) and an
    untied output layer, in two shards with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, max_shard_size="100KB")
    _tokenizer(directory)
    return directory


def save_tiny_mixtral(directory: Path, seed: int = 0) -> Path:
    """A 2-block MixtralForCausalLM: 4 experts, top-2, GQA."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, rope_parameters={"rope_type": "default",
                                                                                             "rope_theta": 10000.0},
    )
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # transformers initializes the router at zero: random routes test more
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(directory)
    _tokenizer(directory)
    return directory


def save_tiny_qwen3(directory: Path, seed: int = 0, tie: bool = True) -> Path:
    """A 2-block Qwen3ForCausalLM: GQA (4 heads / 2 KV) with head_dim 32, so heads x head_dim
    (128) is not the width (64), tied embeddings (as Qwen3's small sizes), and random norm
    weights (transformers starts them at one, which would hide a wrong channel order in the
    q/k norms)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
    model.save_pretrained(directory, max_shard_size="100KB")
    _tokenizer(directory)
    return directory


def save_tiny_qwen3_moe(directory: Path, seed: int = 0, norm_topk_prob: bool = True, **overrides) -> Path:
    """A 3-block Qwen3MoeForCausalLM: Qwen3's attention (4 heads / 2 KV, head_dim 32 apart from
    the width 64), 8 experts of width 24 with top-2 routing, the first block dense (mlp_only_layers,
    width 96: dtmega's first_dense_layers), untied, random norm and router weights (transformers
    starts the router at zero, which would tie every expert's score)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, mlp_only_layers=[0], decoder_sparse_step=1, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=1e-3,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**settings, **overrides})).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
    model.save_pretrained(directory, max_shard_size="100KB")
    _tokenizer(directory)
    return directory


def tiny_deepseek_v3_config(**overrides):
    """transformers' DeepseekV3Config with every feature on, small: low-rank queries, YaRN RoPE
    with mscale, 4 groups (top-2), a shared expert, a dense first block, untied output."""
    from transformers import DeepseekV3Config

    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
        topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=256, rope_interleave=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 0.8},
    )
    settings.update(overrides)
    return DeepseekV3Config(**settings)


def save_tiny_deepseek_v3(directory: Path, seed: int = 0, **overrides) -> Path:
    """A 3-block DeepseekV3ForCausalLM saved by transformers (no MTP layer: transformers saves
    none, though the config keeps num_nextn_predict_layers=1), in shards with an index; random
    router weights and expert biases (transformers starts both at zero: random ones route more)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**overrides)).float().eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "mlp.gate.weight" in name:
                tensor.normal_(0, 0.5)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(-0.3, 0.3)
    model.save_pretrained(directory, max_shard_size="200KB")
    _tokenizer(directory)
    return directory


def quantize_fp8_blocks(source: Path, directory: Path, block: int = 16) -> Path:
    """`source` (an HF model directory) as DeepSeek-V3 stores its weights: every linear layer's
    weight in float8_e4m3 with a float32 `weight_scale_inv` per block x block tile (amax / 448),
    the embedding, output layer, router and norms as they were; `quantization_config` says so.
    A small block makes the tiny model's tiles cross every shard boundary."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    tensors = {}
    index = source / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    from safetensors import safe_open

    for file in files:
        with safe_open(str(source / file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    out = {}
    for name, tensor in tensors.items():
        linear = tensor.dim() == 2 and ("self_attn." in name or ".mlp." in name) and "mlp.gate." not in name
        if not linear:
            out[name] = tensor
            continue
        rows, cols = tensor.shape
        tiles = tensor.new_zeros(-(-rows // block) * block, -(-cols // block) * block)
        tiles[:rows, :cols] = tensor
        tiles = tiles.view(tiles.shape[0] // block, block, tiles.shape[1] // block, block)
        scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
        out[name] = (tensor / expanded).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.float().contiguous()
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((source / name).read_bytes())
    return directory


def dequantized_fp8(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a `quantize_fp8_blocks` directory as the checkpoint means it: an fp8
    weight times its tile's scale, in float32 (the rule written once more, independently of
    dtmega's reader)."""
    from safetensors import safe_open

    block = json.loads((directory / "config.json").read_text())["quantization_config"]["weight_block_size"][0]
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name + "_scale_inv"]
            tensor = tensor.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[
                :tensor.shape[0], :tensor.shape[1]]
        out[name] = tensor
    return out


def save_tiny_gpt2(directory: Path, seed: int = 0, tie: bool = True, activation: str = "gelu_new") -> Path:
    """A 2-block GPT2LMHeadModel (width 64, 4 heads, 128 positions) with random LayerNorm weights
    and biases (transformers starts them at one and zero, which would hide a swapped weight/bias
    or an untransposed Conv1D), in shards with an index."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        activation_function=activation, tie_word_embeddings=tie)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.ndim == 1:
                tensor.uniform_(0.5, 1.5) if name.endswith("ln_1.weight") or "ln_" in name else tensor.normal_(0, 0.05)
    model.save_pretrained(directory, max_shard_size="100KB")
    _tokenizer(directory)
    return directory


def transformers_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of `ids` from the checkpoint in `directory` (no KV cache): the
    ground truth every family's Hugging Face test compares dtmega's logits with."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(ids, use_cache=False).logits


def greedy_three_ways(directory: Path, module, prompt: list[int], vocab_size: int, new_tokens: int):
    """Greedy continuations of `prompt`: (transformers' `generate` on `directory`, dtmega's
    `generate_tokens` with the KV cache, dtmega's model on the whole sequence each step)."""
    from transformers import AutoModelForCausalLM

    from dtmega.train.generate import generate_tokens

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        cached = generate_tokens(module, prompt, vocab_size=vocab_size, eod=None, max_new_tokens=new_tokens,
                                 temperature=0.0).ids
        tokens = list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(module(torch.tensor([tokens]))[0, -1].argmax()))
    return expected, cached, tokens[len(prompt):]
