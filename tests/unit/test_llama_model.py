"""The reference Llama: exact sizes, architecture equal to Meta's (checked against Hugging Face's
implementation with converted weights), causality, and seed-determined initialization."""

from __future__ import annotations

import pytest
import torch

from dtmega.models import Llama, LlamaConfig, RopeScaling
from dtmega.models.rope import apply_rope, rope_cache

META_PARAMS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("name", list(META_PARAMS))
def test_named_configs_have_metas_parameter_counts(name):
    config = LlamaConfig.from_name(name)
    assert config.num_params() == META_PARAMS[name]
    with torch.device("meta"):
        model = Llama(config)
    assert sum(p.numel() for p in model.parameters()) == META_PARAMS[name]


def test_tied_embeddings_share_one_parameter():
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("debug", tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert LlamaConfig.from_name("debug", tie_embeddings=True).num_params() == sum(p.numel() for p in model.parameters())


def test_bad_configs_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="n_heads=8 is not divisible by n_kv_heads=3"):
        LlamaConfig.from_name("debug", n_kv_heads=3)
    with pytest.raises(KeyError, match="unknown Llama config 'llama9'"):
        LlamaConfig.from_name("llama9")


def _to_hf_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's interleaved RoPE pairs -> Hugging Face's rotate-half layout (per head)."""
    out, dim = weight.shape
    head_dim = out // n_heads
    return weight.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def test_logits_equal_hugging_face_llama_with_converted_weights():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    # original_max_seq_len=16 puts the 48-token test sequence in Llama-3.1's scaled regime.
    config = LlamaConfig.from_name(
        "debug", rope_theta=500000.0, max_seq_len=64, rope_scaling=RopeScaling(original_max_seq_len=16)
    )
    model = Llama(config)
    model.init_weights(seed=3)
    hf = LlamaForCausalLM(HFConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, rms_norm_eps=config.norm_eps, max_position_embeddings=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
        tie_word_embeddings=False, attn_implementation="eager",
    ))
    state = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
             "lm_head.weight": model.output.weight}
    for i, block in model.layers.items():
        prefix = f"model.layers.{i}."
        state.update({
            prefix + "self_attn.q_proj.weight": _to_hf_rotary(block.attention.wq.weight, config.n_heads),
            prefix + "self_attn.k_proj.weight": _to_hf_rotary(block.attention.wk.weight, config.n_kv_heads),
            prefix + "self_attn.v_proj.weight": block.attention.wv.weight,
            prefix + "self_attn.o_proj.weight": block.attention.wo.weight,
            prefix + "mlp.gate_proj.weight": block.feed_forward.w1.weight,
            prefix + "mlp.up_proj.weight": block.feed_forward.w3.weight,
            prefix + "mlp.down_proj.weight": block.feed_forward.w2.weight,
            prefix + "input_layernorm.weight": block.attention_norm.weight,
            prefix + "post_attention_layernorm.weight": block.ffn_norm.weight,
        })
    hf.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    tokens = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
    # fp32, two implementations (interleaved vs rotate-half RoPE, other op order) through 2 blocks.
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_attention_is_causal_and_positions_are_honored():
    model = Llama(LlamaConfig.from_name("debug"))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
        shifted = model(tokens, position_ids=torch.arange(12).unsqueeze(0) + 5)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])
    assert not torch.allclose(a, shifted)


def test_rope_depends_only_on_relative_position():
    cache = rope_cache(64, 16, 500000.0, LlamaConfig().rope_scaling)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        return (apply_rope(q, cache[m].view(1, 1, 8, 2)) * apply_rope(k, cache[n].view(1, 1, 8, 2))).sum()

    torch.testing.assert_close(score(3, 1), score(40, 38))


def test_init_is_determined_by_the_seed():
    first, second, other = (Llama(LlamaConfig.from_name("debug")) for _ in range(3))
    first.init_weights(seed=11)
    second.init_weights(seed=11)
    other.init_weights(seed=12)
    for (name, a), b, c in zip(first.named_parameters(), second.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if a.ndim == 2:
            assert not torch.equal(a, c), name
            assert 0.001 < a.std().item() < 0.05, name
        else:
            assert torch.equal(a, torch.ones_like(a)), name
