"""transformers' `DeepseekV3Config` (config.json) <-> dtmega's DeepSeekConfig, both ways.

Refuses what dtmega's model does not compute the same way, naming the field and the fix:
another activation than SiLU, attention or MLP biases, a RoPE type other than default or YaRN,
routed experts without sigmoid scores' normalization rules transformers applies, ungrouped
configs whose group count does not divide the experts.
"""

from __future__ import annotations

from typing import Any

from dtmega.models.deepseek.config import DeepSeekConfig, YarnScaling
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.moe_config import MoEConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"


def _unsupported(source: str, field: str, value: Any, why: str) -> HFFormatError:
    return HFFormatError(f"{source}: {field}={value!r} is not supported by dtmega's DeepSeek family ({why})")


def _rope(config: dict, source: str) -> tuple[float, YarnScaling | None]:
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise _unsupported(source, "rope_type", kind, "default and yarn RoPE only")
    if parameters.get("attention_factor") is not None:
        raise _unsupported(source, "rope_parameters.attention_factor", parameters["attention_factor"],
                           "the factor is derived from mscale and mscale_all_dim, as DeepSeek's checkpoints do")
    return theta, YarnScaling(
        factor=float(parameters["factor"]),
        original_max_seq_len=int(parameters["original_max_position_embeddings"]),
        beta_fast=float(parameters.get("beta_fast") or 32), beta_slow=float(parameters.get("beta_slow") or 1),
        mscale=float(parameters.get("mscale") or 0), mscale_all_dim=float(parameters.get("mscale_all_dim") or 0),
    )


def deepseek_config_from_hf(config: dict, source: str = "config.json") -> DeepSeekConfig:
    """dtmega's DeepSeekConfig for a `DeepseekV3ForCausalLM` config.json."""
    if config.get("hidden_act", "silu") != "silu":
        raise _unsupported(source, "hidden_act", config["hidden_act"], "SwiGLU with SiLU only")
    if config.get("attention_bias"):
        raise _unsupported(source, "attention_bias", True, "MLA projections without biases only")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                  "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        value = config.get(field)  # matrix 3, F19: a string was a TypeError naming no field
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise HFFormatError(f"{source}: {field} = {value!r} is not an integer. Fix: the model's own config.json")
    heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads", heads)) != heads:
        raise _unsupported(source, "num_key_value_heads", config["num_key_value_heads"],
                           "MLA expands the latent to every head; it must equal num_attention_heads")
    theta, yarn = _rope(config, source)
    groups = config.get("n_group")
    moe = MoEConfig(
        num_experts=int(config["n_routed_experts"]), top_k=int(config["num_experts_per_tok"]),
        ffn_dim=int(config["moe_intermediate_size"]), first_dense_layers=int(config.get("first_k_dense_replace", 0)),
        shared_expert_ffn_dim=int(config["moe_intermediate_size"]) * int(config.get("n_shared_experts") or 0),
        score_func="sigmoid", route_scale=float(config.get("routed_scaling_factor", 1.0)),
        num_groups=int(groups) if groups and int(groups) > 1 else None,
        group_topk=int(config["topk_group"]) if groups and int(groups) > 1 else None,
        load_balancing="none", aux_loss_coeff=0.0, expert_bias=True,
    )
    if not config.get("norm_topk_prob", True) and moe.top_k > 1:
        raise _unsupported(source, "norm_topk_prob", False, "DeepSeek-V3 normalizes the chosen experts' weights")
    return DeepSeekConfig(
        dim=int(config["hidden_size"]), n_layers=int(config["num_hidden_layers"]), n_heads=heads,
        vocab_size=int(config["vocab_size"]), ffn_dim=int(config["intermediate_size"]),
        q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]), qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]), norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        yarn=yarn, max_seq_len=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=float(config.get("initializer_range", 0.02)), moe=moe,
        mtp_num_layers=int(config.get("num_nextn_predict_layers", 0) or 0),
    )


def hf_config_from_deepseek(config: DeepSeekConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """config.json for `config` as transformers' DeepseekV3ForCausalLM (over `base`, a source
    checkpoint's own config, so its other fields survive)."""
    moe = config.moe
    if moe is None or moe.score_func != "sigmoid" or not moe.expert_bias:
        raise HFFormatError("DeepseekV3ForCausalLM routes with sigmoid scores and an expert bias; this config does "
                            "not. Fix: export a DeepSeek-V3-style MoE config")
    if moe.shared_expert_ffn_dim % moe.ffn_dim:
        raise HFFormatError(f"shared experts of {moe.shared_expert_ffn_dim} channels are not a whole number of "
                            f"experts of {moe.ffn_dim} (transformers' n_shared_experts)")
    out = dict(base or {})
    out.update(
        architectures=[ARCHITECTURE], model_type="deepseek_v3", hidden_size=config.dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_heads,
        vocab_size=config.vocab_size, intermediate_size=config.ffn_dim, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, head_dim=config.qk_rope_head_dim,
        rms_norm_eps=config.norm_eps, max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=config.tie_embeddings, initializer_range=config.init_std, hidden_act="silu",
        attention_bias=False, rope_interleave=True, n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.ffn_dim,
        n_shared_experts=moe.shared_expert_ffn_dim // moe.ffn_dim, first_k_dense_replace=moe.first_dense_layers,
        routed_scaling_factor=moe.route_scale, n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1,
        norm_topk_prob=True, num_nextn_predict_layers=config.mtp_num_layers, dtype=dtype,
    )
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.yarn is not None:
        y = config.yarn
        rope.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_max_seq_len,
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    out["rope_parameters"] = rope
    out.pop("rope_scaling", None)
    return out
