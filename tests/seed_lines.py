"""The seeds' two launch lines (issue 51, item 3), as this repository can hold them.

The seeds' own text is not in this repository or its shared folder; these lines are rebuilt from
what issue 51 quotes of them — "Train LLaMA-style model with 3D parallelism", the 70B row: TP 4,
PP 4 on 64 GPUs, 80 layers, 8,192 wide, GPT-2's BPE from --vocab-file/--merge-file, and no
--swiglu; the MoE workflow: TP 2, EP 4, 8 experts, top-2 — with Megatron's flags for everything
else the issue does not say (sequence 4,096, 64 heads for the 70B; a 2,048-wide, 24-layer model
for the MoE line, which names no size in the issue). Without --swiglu, `pretrain_gpt.py` builds
GPT blocks, and so does dtmega. The data flags are the only ones changed: --mock-data and the
GPT-2 BPE's vocabulary size in place of --data-path/--vocab-file/--merge-file.
"""

from __future__ import annotations

LLAMA_70B_3D = """
--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --sequence-parallel
--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --seq-length 4096 --max-position-embeddings 4096
--micro-batch-size 1 --global-batch-size 1024 --train-iters 500000 --lr 1.5e-4 --min-lr 1.5e-5
--lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --bf16
--use-distributed-optimizer --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10
"""
MOE_TP2_EP4 = """
--tensor-model-parallel-size 2 --expert-model-parallel-size 4 --sequence-parallel
--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096
--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--disable-bias-linear --micro-batch-size 1 --global-batch-size 256 --train-iters 500000 --lr 3e-4 --min-lr 3e-5
--lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --bf16
--use-distributed-optimizer --log-interval 10 --save-interval 1000 --eval-interval 1000 --eval-iters 10
"""
MOCK_GPT2_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"]
WORLDS = {"llama_70b_3d": 64, "moe_tp2_ep4": 32}


def megatron_gpt_count(layers: int, hidden: int, vocab: int, positions: int, *, ffn: int | None = None,
                       experts: int = 0, biases: bool = True) -> int:
    """Megatron's parameter count of a GPT model with tied embeddings, counted here from its
    layers (not from dtmega's config): word and position embeddings, per block two LayerNorms
    (weight and bias), QKV and output projections, a GeLU MLP (or `experts` GeLU experts without
    biases and a router), and the final LayerNorm."""
    ffn = ffn or 4 * hidden
    norms = 2 * (2 * hidden)
    attention = 4 * hidden * hidden + (4 * hidden if biases else 0)
    if experts:
        mlp = experts * 2 * hidden * ffn + hidden * experts
    else:
        mlp = 2 * hidden * ffn + ((ffn + hidden) if biases else 0)
    return vocab * hidden + positions * hidden + layers * (norms + attention + mlp) + 2 * hidden


def padded(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of --make-vocab-size-divisible-by x TP."""
    step = multiple * tp
    return -(-vocab // step) * step
