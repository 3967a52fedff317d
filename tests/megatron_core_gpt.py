"""Writes a Megatron-Core checkpoint with megatron-core itself, on CPU: a small GPTModel (2
layers, width 64, 4 heads in 2 query groups, SwiGLU, RMSNorm, RoPE, untied output), its
logits on fixed tokens, and `dist_checkpointing.save` in the torch_dist format. Run under
torchrun (`--nproc-per-node 2` saves a tensor-parallel TP2 original):

    torchrun --nproc-per-node 2 tests/megatron_core_gpt.py OUT_DIR [--gpt-blocks [--qk-layernorm]]

megatron-core 0.16 assumes CUDA in four places that a CPU run reaches; each is replaced for
this process only (they run nothing CUDA-specific here): `torch.cuda.current_device` (where
buffers and the RoPE frequencies are placed), `torch.cuda.synchronize` (before the async
writer copies tensors), the CUDA RNG tracker's `fork` around attention dropout (dropout is 0),
and the default causal mask, made on "cuda" (an explicit mask is passed instead).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, SEQ = 264, 16  # dtmega's byte tokenizer (258 ids) fits; TP2 divides it


def main(out: str, gpt_blocks: bool = False, qk_layernorm: bool = False, rotary_percent: float = 1.0) -> None:
    """`gpt_blocks`: Megatron's GPT blocks instead (what pretrain_gpt.py builds without --swiglu):
    LayerNorm, learned absolute positions, biases on every linear layer, a GeLU MLP of 4 x hidden
    (F.gelu: --no-bias-gelu-fusion), the output tied to the word embedding; dropout 0 (a forward
    in eval mode drops nothing anyway). `qk_layernorm` (with gpt_blocks): --qk-layernorm (a
    LayerNorm on each query and key head) with RoPE instead of learned positions, so the norms'
    per-head vectors are read in Megatron's half-split channel order. `rotary_percent` (with RoPE):
    Megatron's partial rotary, RoPE on each head's first int(head_dim x it) channels."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    block = dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                 ffn_hidden_size=128)
    if gpt_blocks:
        block = dict(gated_linear_unit=False, activation_func=F.gelu, normalization="LayerNorm", add_bias_linear=True,
                     ffn_hidden_size=256)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, **block,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, layernorm_epsilon=1e-5,
    )
    spec = get_gpt_layer_local_spec(normalization=block["normalization"], qk_layernorm=qk_layernorm)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                     position_embedding_type="learned_absolute" if gpt_blocks and not qk_layernorm else "rope",
                     rotary_base=10000, rotary_percent=rotary_percent,
                     share_embeddings_and_output_weights=gpt_blocks).eval()
    if gpt_blocks:  # biases and LayerNorm weights start at 0 and 1: random, so a misplaced one shows; the MLP's
        # inputs O(1) (its weights x 20), where GeLU's erf and tanh forms differ by ~1e-3, not ~1e-6
        generator = torch.Generator().manual_seed(5)  # the same on every rank: replicated tensors agree
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or "layernorm" in name or "layer_norm" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + (1.0 if "weight" in name else 0.0))
                elif name.endswith("linear_fc1.weight"):
                    param.mul_(20.0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    with torch.no_grad():
        local = model(tokens, positions, mask)  # [B, S, V / tp]: vocab-parallel
    pieces = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(pieces, local.contiguous())
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        torch.save({"tokens": tokens, "logits": torch.cat(pieces, dim=-1)}, os.path.join(out, "logits.pt"))
        os.makedirs(os.path.join(out, "iter_0000001"), exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), os.path.join(out, "iter_0000001"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # the torch_dist writer's spawned helper re-imports this file
    # The process ends normally, not with os._exit as benchmarks/common.run_worker does: the
    # torch_dist writer's spawned multiprocessing Manager is shut down at exit, and skipping that
    # would leave it holding the caller's pipes open (the test waiting on them forever).
    percent = float(sys.argv[sys.argv.index("--rotary-percent") + 1]) if "--rotary-percent" in sys.argv else 1.0
    main(sys.argv[1], gpt_blocks="--gpt-blocks" in sys.argv[2:], qk_layernorm="--qk-layernorm" in sys.argv[2:],
         rotary_percent=percent)
