"""`dtmega convert megatron-to-dtmega`: its flags (Megatron's names) and the conversion."""

from __future__ import annotations

import argparse
from pathlib import Path

from dtmega.data.tokenizers import TOKENIZER_TYPES, TokenizerSpec, build_tokenizer
from dtmega.interop.megatron_core import (
    MegatronArchitecture,
    MegatronCheckpoint,
    MegatronFormatError,
    dtmega_state_from_megatron,
    llama_config_from_megatron,
)
from dtmega.interop.megatron_core_gpt import GPTBlockFlags, gpt_config_from_megatron, gpt_state_from_megatron, is_gpt_checkpoint


def add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, the destination, and the flags of the Megatron run its shapes do not say."""
    parser.add_argument("--load", required=True, help="the torch_dist iter_* directory Megatron-Core wrote")
    parser.add_argument("--save", required=True, help="dtmega checkpoint directory to write (iter_0000000)")
    parser.add_argument("--num-attention-heads", type=int, required=True)
    parser.add_argument("--num-query-groups", type=int, help="key/value heads (default: no grouping)")
    parser.add_argument("--rotary-base", type=float, default=10000.0)
    parser.add_argument("--rotary-interleaved", action="store_true", help="the run rotated adjacent pairs")
    parser.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1 RoPE frequency scaling")
    parser.add_argument("--rope-scaling-factor", type=float, default=8.0)
    parser.add_argument("--norm-epsilon", type=float, default=1e-5)
    parser.add_argument("--max-position-embeddings", type=int, default=4096)
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, required=True)
    parser.add_argument("--tokenizer-model", help="tokenizer.json, tokenizer.model or a tokenizer directory")
    parser.add_argument("--vocab-file")
    parser.add_argument("--merge-file")
    parser.add_argument("--eod-token")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer: the token ids are 0..N-1, N is end-of-document")
    # GPT blocks (LayerNorm, biases, GeLU; docs/gpt.md): what their tensors do not show
    parser.add_argument("--squared-relu", action="store_true", help="GPT blocks: the MLP was squared ReLU, not GeLU")
    parser.add_argument("--no-bias-gelu-fusion", action="store_true",
                        help="GPT blocks: the GeLU was F.gelu (erf), not the fused bias-GeLU's tanh form")
    parser.add_argument("--apply-layernorm-1p", action="store_true", help="GPT blocks: zero-centred norm weights")
    parser.add_argument("--attention-dropout", type=float, default=0.1, help="GPT blocks: the converted model's")
    parser.add_argument("--hidden-dropout", type=float, default=0.1, help="GPT blocks: the converted model's")
    parser.add_argument("--rotary-percent", type=float, default=1.0,
                        help="GPT blocks with RoPE: the share of each head's channels the run rotated")


def convert_megatron(a: argparse.Namespace) -> Path:
    """Checks everything (checkpoint keys, shapes against the flags, tokenizer against the
    embedding), then reads the checkpoint tensor by tensor into a dtmega checkpoint: a Llama, or
    a GPT for Megatron's GPT blocks (dtmega/interop/megatron_core_gpt.py)."""
    import dataclasses

    import torch

    from dtmega.interop.hf_import import DEFAULT_SEQ_LENGTH
    from dtmega.models.gpt import GPT
    from dtmega.models.llama import Llama
    from dtmega.models.llama.specs import llama_config_to_dict
    from dtmega.train.checkpoint import save_checkpoint
    from dtmega.train.save_ownership import new_run_id

    checkpoint = MegatronCheckpoint(a.load)
    arch = MegatronArchitecture(a.num_attention_heads, a.num_query_groups, a.rotary_base, a.rotary_interleaved,
                                a.use_rope_scaling, a.rope_scaling_factor, a.norm_epsilon, a.max_position_embeddings)
    if is_gpt_checkpoint(checkpoint) or a.rotary_percent != 1.0:  # partial rotary: GPT blocks (any shape)
        flags = GPTBlockFlags(a.squared_relu, a.no_bias_gelu_fusion, a.apply_layernorm_1p, a.attention_dropout,
                              a.hidden_dropout, a.rotary_percent)
        config = gpt_config_from_megatron(checkpoint, arch, flags)
        name, build, to_dict, read, embedding = "gpt", GPT, dataclasses.asdict, gpt_state_from_megatron, \
            "embedding.word.weight"
    else:
        config = llama_config_from_megatron(checkpoint, arch)
        name, build, to_dict, read, embedding = "llama", Llama, llama_config_to_dict, dtmega_state_from_megatron, \
            "tok_embeddings.weight"
    spec = TokenizerSpec(a.tokenizer_type, a.tokenizer_model, a.vocab_file, a.merge_file, a.eod_token, a.vocab_size)
    tokenizer = build_tokenizer(spec)
    if tokenizer.vocab_size > config.vocab_size:
        raise MegatronFormatError(f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's embedding "
                                  f"only {config.vocab_size} rows. Fix: the tokenizer the run was trained with")
    weights = read(checkpoint, config, a.rotary_interleaved)
    unread = checkpoint.unread_weights()
    if unread:  # a feature of the run this conversion does not know: refused, never dropped
        shown = ", ".join(unread[:6]) + (f" and {len(unread) - 6} more" if len(unread) > 6 else "")
        raise MegatronFormatError(
            f"{checkpoint.path} holds weights the dtmega {name} model would not read: {shown}. Converting would drop "
            "them and compute another model. Fix: none yet for these weights (docs/checkpoints.md lists the keys "
            "read); convert through Hugging Face if the model exists there")
    if config.tie_embeddings:
        weights["output.weight"] = weights[embedding]
    with torch.device("meta"):
        model = build(config)
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:  # a bug of the mapping, not of the input
        raise RuntimeError(f"megatron-to-dtmega mapping incomplete: missing {missing}, unexpected {unexpected}")
    state = {"iteration": 0, "consumed_samples": 0, "world_size": 1, "model": name, "model_config": to_dict(config),
             "args": {"seq_length": min(config.max_seq_len, DEFAULT_SEQ_LENGTH)}, "tokenizer": spec.to_dict(),
             "source": {"megatron_core": str(checkpoint.path.resolve())}, "run_id": new_run_id()}
    return save_checkpoint(a.save, 0, model, None, state, tokenizer_json=tokenizer.to_json(),
                           allow_older=getattr(a, "overwrite_checkpoints", False))
