"""Where each dtmega DeepSeek weight lives in a Hugging Face `DeepseekV3ForCausalLM` checkpoint,
tensor by tensor (`hf_source`: what the sharded reader reads; `hf_tensors`: what the exporter
writes), and whole state dicts both ways (tests, in-memory conversion).

Routed experts come either as DeepSeek's checkpoint files (and transformers' `save_pretrained`)
hold them, one `gate_proj`, `up_proj`, `down_proj` per expert, or as transformers holds them in
memory (`gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I]); files are read per expert, the
in-memory form is accepted by `dtmega_state_from_hf`, and the per-expert form is written. The
router's `e_score_correction_bias` is dtmega's `expert_bias`.

Multi-token prediction: depth k's module is the checkpoint's layer `num_hidden_layers + k`
(DeepSeek-V3's `model.layers.61.*`): `enorm`, `hnorm`, `eh_proj`, a decoder layer's own names
and `shared_head.norm` (dtmega's `mtp.{k}.norm`). Its `embed_tokens` and `shared_head.head` are
copies of the model's embedding and output layer, which dtmega shares: they are written on
export and not read back (the shared tensors are).

RoPE: dtmega rotates adjacent channel pairs, as DeepSeek's checkpoints lay out the rotary
channels (transformers' `rope_interleave=True`). A config with `rope_interleave=False` rotates
channel i with i + d/2; its rotary rows are permuted into pairs on the way in (the query's
rotary rows of every head, and the shared rotary key's rows).
"""

from __future__ import annotations

import functools
import re

import torch

from dtmega.models.deepseek.config import DeepSeekConfig
from dtmega.models.llama.hf_names import WeightSource, hf_rows_to_dtmega, top_level_source

_ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
_DENSE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP_NAME = re.compile(r"mtp\.(\d+)\.(.+)")


def _query_rows(block: torch.Tensor, heads: int, nope: int) -> torch.Tensor:
    """A query projection's rows of `heads` whole heads with each head's rotary rows (after its
    `nope` rows) moved from HF's half-split order into dtmega's pairs."""
    per_head = block.view(heads, block.shape[0] // heads, -1)
    rope = per_head.shape[1] - nope
    rotary = hf_rows_to_dtmega(per_head[:, nope:].reshape(heads * rope, -1), heads)
    return torch.cat([per_head[:, :nope], rotary.view(heads, rope, -1)], dim=1).reshape(block.shape)


def _latent_rows(block: torch.Tensor, heads: int, latent: int) -> torch.Tensor:
    """`kv_a_proj_with_mqa`'s rows: the latent's `latent` rows as they are, then the shared rotary
    key's rows moved into dtmega's pairs."""
    return torch.cat([block[:latent], hf_rows_to_dtmega(block[latent:], 1)])


def _block_source(prefix: str, rest: str, config: DeepSeekConfig, moe_layer: bool,
                  rope_interleave: bool) -> WeightSource:
    """The HF source of a decoder block's tensor `rest` (dtmega's name inside the block), the
    block's HF names starting with `prefix`."""
    if rest in _NORMS:
        return WeightSource((prefix + _NORMS[rest],))
    parts = rest.split(".")
    if parts[0] == "attention" and parts[1] in _ATTENTION:
        name = f"{prefix}self_attn.{_ATTENTION[parts[1]]}.weight"
        if not rope_interleave and parts[1] in ("wq", "wq_b"):
            return WeightSource((name,), config.n_heads, config.qk_head_dim,
                                functools.partial(_query_rows, nope=config.qk_nope_head_dim))
        if not rope_interleave and parts[1] == "wkv_a":
            return WeightSource((name,), 1, config.kv_lora_rank + config.qk_rope_head_dim,
                                functools.partial(_latent_rows, latent=config.kv_lora_rank))
        return WeightSource((name,))
    if parts[0] != "feed_forward":
        raise KeyError(rest)
    if not moe_layer and parts[1] in _DENSE:
        return WeightSource((f"{prefix}mlp.{_DENSE[parts[1]]}.weight",))
    if rest == "feed_forward.router.gate.weight":
        return WeightSource((prefix + "mlp.gate.weight",))
    if rest == "feed_forward.router.expert_bias":
        return WeightSource((prefix + "mlp.gate.e_score_correction_bias",))
    if parts[1] == "shared_experts":
        return WeightSource((f"{prefix}mlp.shared_experts.{_DENSE[parts[2]]}.weight",))
    if parts[1] == "experts":
        return WeightSource(tuple(f"{prefix}mlp.experts.{e}.{_DENSE[parts[2]]}.weight"
                                  for e in range(config.moe.num_experts)), stacked=True)
    raise KeyError(rest)


def hf_source(name: str, config: DeepSeekConfig, hf_names: set[str] | None = None,
              rope_interleave: bool = True) -> WeightSource:
    """The HF tensor(s) dtmega's `name` is read from (`hf_names`: the checkpoint's tensors, to
    find a tied `lm_head`). KeyError for a name with no HF counterpart."""
    top = top_level_source(name, config.tie_embeddings, hf_names)
    if top is not None:
        return top
    match = _LAYER.fullmatch(name)
    if match is not None:
        index, rest = match.groups()
        moe_layer = config.moe is not None and config.moe.is_moe_layer(int(index))
        return _block_source(f"model.layers.{index}.", rest, config, moe_layer, rope_interleave)
    match = _MTP_NAME.fullmatch(name)
    if match is None:
        raise KeyError(name)
    depth, rest = int(match.group(1)), match.group(2)
    prefix = f"model.layers.{config.n_layers + depth}."
    if rest in _MTP:
        return WeightSource((prefix + _MTP[rest],))
    if not rest.startswith("block."):
        raise KeyError(name)
    moe_layer = config.moe is not None and config.moe.is_moe_layer(config.n_layers)
    return _block_source(prefix, rest.removeprefix("block."), config, moe_layer, rope_interleave)


def mtp_copies(config: DeepSeekConfig) -> dict[str, list[str]]:
    """The HF names that hold copies of a shared dtmega tensor: each MTP layer's `embed_tokens`
    (the embedding) and `shared_head.head` (the output layer)."""
    layers = [f"model.layers.{config.n_layers + depth}." for depth in range(config.mtp_num_layers)]
    return {"tok_embeddings.weight": [p + "embed_tokens.weight" for p in layers],
            "output.weight": [p + "shared_head.head.weight" for p in layers]}


def hf_tensors(name: str, tensor: torch.Tensor, config: DeepSeekConfig) -> dict[str, torch.Tensor]:
    """dtmega's full tensor `name` as the HF tensors it becomes (export, paired rotary rows as
    `rope_interleave=True` reads them; a tied output written once, as the embedding; the MTP
    layers' copies of the embedding and output layer written beside them)."""
    copies = mtp_copies(config)
    out: dict[str, torch.Tensor] = {}
    if name == "tok_embeddings.weight" and config.tie_embeddings:
        out.update({hf: tensor.clone() for hf in copies["output.weight"]})
    if name == "output.weight" and config.tie_embeddings:
        return out
    out.update({hf: tensor.clone() for hf in copies.get(name, [])})  # files hold each copy apart
    source = hf_source(name, config)
    if source.stacked:
        out.update({hf: tensor[e] for e, hf in enumerate(source.names)})
    else:
        out[source.names[0]] = tensor
    return out


def dtmega_state_from_hf(hf: dict[str, torch.Tensor], config: DeepSeekConfig,
                         rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """dtmega's state dict from a whole HF state dict (per-expert or transformers' in-memory
    fused experts)."""
    hf = dict(hf)
    for key in [k for k in hf if k.endswith("mlp.experts.gate_up_proj")]:
        prefix = key.removesuffix("gate_up_proj")
        gate, up = hf.pop(key).chunk(2, dim=1)
        down = hf.pop(prefix + "down_proj")
        for e in range(gate.shape[0]):
            hf.update({f"{prefix}{e}.gate_proj.weight": gate[e], f"{prefix}{e}.up_proj.weight": up[e],
                       f"{prefix}{e}.down_proj.weight": down[e]})
    with torch.device("meta"):
        from dtmega.models.deepseek.model import DeepSeek

        names = list(DeepSeek(config).state_dict())
    out = {}
    for name in names:
        source = hf_source(name, config, set(hf), rope_interleave)
        if source.stacked:
            out[name] = torch.stack([hf[n] for n in source.names])
        elif source.heads:
            out[name] = source.reorder(hf[source.names[0]], source.heads)
        else:
            out[name] = hf[source.names[0]]
    return out


def hf_state_from_dtmega(state: dict[str, torch.Tensor], config: DeepSeekConfig) -> dict[str, torch.Tensor]:
    """The HF checkpoint tensors of dtmega's full state dict."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        try:
            out.update(hf_tensors(name, tensor, config))
        except KeyError:
            raise KeyError(f"{name} has no DeepseekV3ForCausalLM counterpart") from None
    return out
