"""Where each dtmega GPT weight lives in a Hugging Face GPT2LMHeadModel checkpoint.

GPT-2's projections are `Conv1D` layers storing [in, out] (dtmega's nn.Linear stores [out, in]:
transposed both ways), and q, k, v are one `c_attn` tensor [dim, 3 * dim] whose columns are the
queries, then the keys, then the values (each in head order, as dtmega's rows: no permutation,
GPT-2 has no RoPE)."""

from __future__ import annotations

import re

import torch

from dtmega.models.gpt.config import GPTConfig
from dtmega.models.llama.hf_names import HFPart, WeightSource

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_PLAIN = {  # dtmega name in a block -> GPT-2 name in transformer.h.{i}
    "attention_norm.weight": "ln_1.weight", "attention_norm.bias": "ln_1.bias",
    "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
}
_CONV = {  # dtmega linear -> GPT-2 Conv1D
    "attention.wo": "attn.c_proj", "feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj",
}
_QKV = ("attention.wq", "attention.wk", "attention.wv")
_TOP = {"embedding.word.weight": "transformer.wte.weight", "embedding.position.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}


def hf_source(name: str, config: GPTConfig, hf_names: set[str] | None = None) -> WeightSource:
    """The HF tensor dtmega's `name` is read from; KeyError for a name with no HF counterpart."""
    if name in _TOP:
        return WeightSource((_TOP[name],))
    if name == "output.weight":
        untied = not config.tie_embeddings and hf_names is not None and "lm_head.weight" in hf_names
        return WeightSource(("lm_head.weight" if untied else "transformer.wte.weight",))
    match = _LAYER.fullmatch(name)
    if match is None:
        raise KeyError(name)
    layer, local = match.groups()
    prefix = f"transformer.h.{layer}."
    if local in _PLAIN:
        return WeightSource((prefix + _PLAIN[local],))
    module, _, kind = local.rpartition(".")
    dim = config.dim
    if module in _QKV:
        offset = _QKV.index(module) * dim
        if kind == "weight":
            return WeightSource((prefix + "attn.c_attn.weight",), transpose=True, offset=offset, hf_shape=(dim, 3 * dim))
        return WeightSource((prefix + "attn.c_attn.bias",), offset=offset, hf_shape=(3 * dim,))
    if module in _CONV:
        hf = prefix + _CONV[module] + "." + kind
        if kind == "weight":
            rows, cols = (dim, config.hidden_ffn) if module == "feed_forward.w1" else \
                (config.hidden_ffn, dim) if module == "feed_forward.w2" else (dim, dim)
            return WeightSource((hf,), transpose=True, hf_shape=(rows, cols))
        return WeightSource((hf,))
    raise KeyError(name)


def hf_tensors(name: str, tensor: torch.Tensor, config: GPTConfig) -> dict:
    """dtmega's full tensor `name` as the HF tensors it becomes (export): Conv1D weights transposed,
    q/k/v as parts of c_attn."""
    source = hf_source(name, config, {"lm_head.weight"})
    (hf,) = source.names
    match = _LAYER.fullmatch(name)
    module = match.group(2).rpartition(".")[0] if match else ""
    value = tensor.t() if source.transpose else tensor
    if module in _QKV:
        return {hf: HFPart(_QKV.index(module), 3, 1 if source.transpose else 0, value)}
    return {hf: value}
