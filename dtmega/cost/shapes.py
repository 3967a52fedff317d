"""What the cost model reads: the model's shapes and the plan's choices, as plain numbers.

`PlanShape` is the same plan the passes annotate, said in sizes (TP 8, PP 4 x 2 virtual, CP 2
ring, FSDP over 16, ...); `plan_shape_of(program)` reads it back from an annotated layout, so the
estimate of a checked plan and of a plan the search proposes come from one set of formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from dtmega.models.llama.config import LlamaConfig
from dtmega.models.moe_config import MoEConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes: Llama-style grouped-query attention, or DeepSeek's multi-latent
    attention (`mla`), dense or mixture of experts.

    With MLA every head has a query/key of qk_head_dim = nope + rope channels and a value of
    v_head_dim, and keys and values are expanded to every head: `q_dim` and `kv_dim` are then
    heads x (qk_head_dim + v_head_dim) / 2, so that the formulas below count exactly what GQA's
    count, q + output and k + v widths saved for attention's backward, and the scores' and
    values' FLOPs. Not counted: the latents' own activations (q_lora_rank + kv_lora_rank +
    rope channels per token, ~3 % of the attention's for DeepSeek-V3), and tensor parallelism
    splits all attention parameters (MLA keeps the down-projections whole: ~8 % of V3's).
    """

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    moe_layers: int = 0
    shared_ffn: int = 0
    capacity_factor: float | None = None
    mla: object | None = None  # passes.families.base.LatentAttentionFacts
    mtp_layers: int = 0  # DeepSeek's multi-token-prediction depths (MLA models)
    groups: int | None = None  # group-limited routing: expert groups, and the best ones a token uses
    group_topk: int | None = None
    # width of one query/key head when it is not dim / heads (Qwen3, Megatron's --kv-channels); 0: dim / heads
    head_width: int = 0
    # Megatron's GPT blocks (dtmega/models/gpt: its GPTConfig): biases, LayerNorm, a GeLU or
    # squared-ReLU MLP of two matrices, learned positions, dropout; None: a Llama block
    gpt: object | None = None

    @classmethod
    def of(cls, config: LlamaConfig) -> "ModelShape":
        """The sizes of a dtmega Llama config."""
        moe = config.moe
        moe_layers = sum(moe.is_moe_layer(i) for i in range(config.n_layers)) if moe else 0
        return cls(config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.ffn_dim, config.vocab_size,
                   config.tie_embeddings, moe.num_experts if moe else 0, moe.top_k if moe else 0,
                   moe.ffn_dim if moe else 0, moe_layers, moe.shared_expert_ffn_dim if moe else 0,
                   moe.capacity_factor if moe else None, head_width=config.kv_channels or 0)

    @property
    def head_dim(self) -> int:
        if self.mla is not None:
            return (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim + self.mla.v_head_dim) // 2
        return self.head_width or self.dim // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        """wq, wk, wv, wo of one block (MLA: its projections and latent norms)."""
        if self.mla is not None:
            return self.deepseek_config.attention_params()
        count = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim
        if self.gpt is not None:  # biases (q, k, v with --add-qkv-bias; the output's), the q/k norms
            g = self.gpt
            count += (self.q_dim + 2 * self.kv_dim) * g.has_qkv_bias + self.dim * g.bias
            count += 2 * self.head_dim * (2 if g.normalization == "LayerNorm" else 1) * g.qk_norm
        return count

    def norm_params(self) -> int:
        """One norm layer over the width (LayerNorm: weight and bias)."""
        return self.dim * (2 if self.gpt is not None and self.gpt.normalization == "LayerNorm" else 1)

    def position_params(self) -> int:
        """The learned position table (GPT blocks' learned_absolute), on the first pipeline rank."""
        g = self.gpt
        return g.max_seq_len * self.dim if g is not None and g.position_embedding == "learned_absolute" else 0

    @property
    def mlp_matrices(self) -> int:
        """SwiGLU's gate, up and down; a GeLU or squared-ReLU MLP's up and down."""
        return 3 if self.gpt is None or self.gpt.activation == "swiglu" else 2

    @property
    def expert_matrices(self) -> int:
        return 3 if self.gpt is None or self.gpt.moe is None or self.gpt.moe.activation == "swiglu" else 2

    @cached_property
    def deepseek_config(self):
        """The same sizes as a DeepSeekConfig (MLA shapes), for its counts."""
        from dtmega.models.deepseek.config import DeepSeekConfig

        m = self.mla
        moe = MoEConfig(num_experts=self.experts, top_k=self.top_k, ffn_dim=self.expert_ffn,
                        first_dense_layers=self.layers - self.moe_layers, shared_expert_ffn_dim=self.shared_ffn,
                        capacity_factor=self.capacity_factor) if self.experts else None
        return DeepSeekConfig(dim=self.dim, n_layers=self.layers, n_heads=self.heads, vocab_size=self.vocab,
                              ffn_dim=self.ffn, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                              qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                              v_head_dim=m.v_head_dim, tie_embeddings=self.tied, yarn=None, moe=moe,
                              mtp_num_layers=self.mtp_layers)

    def dense_mlp_params(self) -> int:
        biases = (self.ffn * (self.mlp_matrices - 1) + self.dim) * self.gpt.bias if self.gpt is not None else 0
        return self.mlp_matrices * self.dim * self.ffn + biases

    def ranks_per_token(self, ep: int) -> float:
        """Expected number of expert-parallel ranks a token's top-k experts lie on (experts dealt
        to ranks in equal consecutive runs, the router's choices taken as uniform): what the flex
        dispatcher sends a token to, one row each. Group-limited routing bounds it: with groups
        of whole ranks, the ranks of `group_topk` groups; with ranks of whole groups, those of
        the chosen groups' ranks."""
        k, experts = self.top_k, self.experts
        if ep <= 1 or not experts:
            return 1.0
        if self.groups and self.group_topk and self.groups > 1:
            if self.groups >= ep:  # each rank holds groups / ep whole groups: distinct ranks of the chosen groups
                held = self.groups // ep
                return min(k, ep * (1 - math.comb(self.groups - held, self.group_topk) /
                                    math.comb(self.groups, self.group_topk)))
            reach = self.group_topk * ep // self.groups  # each group spans ep / groups ranks
            candidates = self.group_topk * experts // self.groups
            return _distinct_ranks(candidates, reach, k)
        return _distinct_ranks(experts, ep, k)

    def expert_params(self) -> int:
        """All routed experts of one MoE block."""
        return self.expert_matrices * self.dim * self.expert_ffn * self.experts

    @cached_property
    def config(self) -> LlamaConfig:
        """The same sizes as a LlamaConfig (MoE blocks after the dense ones), whose own counts
        (`num_params`, the trainer's FLOPs per token) the cost model uses: one formula each."""
        moe = MoEConfig(num_experts=self.experts, top_k=self.top_k, ffn_dim=self.expert_ffn,
                        first_dense_layers=self.layers - self.moe_layers, shared_expert_ffn_dim=self.shared_ffn,
                        capacity_factor=self.capacity_factor) if self.experts else None
        return LlamaConfig(dim=self.dim, n_layers=self.layers, n_heads=self.heads, n_kv_heads=self.kv_heads,
                           vocab_size=self.vocab, ffn_dim=self.ffn, tie_embeddings=self.tied, moe=moe,
                           kv_channels=self.head_width or None)

    def total_params(self) -> int:
        """Every parameter (LlamaConfig.num_params)."""
        return self._param_count

    @cached_property
    def _param_count(self) -> int:  # counted once per shape: the planner asks for it per candidate
        if self.mla is not None:
            return self.deepseek_config.num_params(with_mtp=True)
        if self.gpt is not None:
            return self.gpt.num_params()
        return self.config.num_params()

    def flops_per_token(self, seq: int) -> float:
        """Model FLOPs per trained token (forward + backward), PaLM's accounting, as the trainer's
        MFU counts them (`llama_flops_per_token`): 6 x active non-embedding parameters + 12 x
        layers x dim x seq."""
        from dtmega.models.llama.specs import llama_flops_per_token

        known = self.__dict__.setdefault("_flops_per_token", {})  # per seq, once (a frozen dataclass's cache)
        if seq not in known:
            if self.mla is not None:
                from dtmega.models.deepseek.specs import deepseek_flops_per_token

                known[seq] = deepseek_flops_per_token(self.deepseek_config, seq)
            elif self.gpt is not None:
                from dtmega.models.gpt.specs import gpt_flops_per_token

                known[seq] = gpt_flops_per_token(self.gpt, seq)
            else:
                known[seq] = llama_flops_per_token(self.config, seq)
        return known[seq]


def _distinct_ranks(experts: int, ranks: int, k: int) -> float:
    """Expected distinct ranks among k distinct experts drawn from `experts` dealt evenly over
    `ranks`: each rank is missed with probability C(E - E/r, k) / C(E, k)."""
    per = experts // ranks
    if k > experts:
        return float(ranks)
    return ranks * (1 - math.comb(experts - per, k) / math.comb(experts, k))


@dataclass(frozen=True)
class PlanShape:
    """A plan in sizes. `dp` counts every data-parallel rank (EP borrows from them); FSDP shards
    dense weights over `fsdp_ranks` and experts over `fsdp_ranks / ep`."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    vp: int = 1
    schedule: str = "1f1b"
    cp: int = 1
    cp_method: str = "ring"
    dp: int = 1
    # fsdp | hsdp | ddp (dtmega, torchtitan); distributed-optimizer (Megatron: weights and
    # gradients whole on every data rank, the fp32 master weights and Adam state sharded) |
    # megatron-fsdp (Megatron's FSDP: everything sharded)
    dp_mode: str = "fsdp"
    dp_shard: int = 1  # HSDP: ranks one replica shards over (dp for fsdp)
    ep: int = 1
    dispatcher: str = "alltoall"  # alltoall (a row per routed expert) | flex (a row per token and rank)
    micro_batch: int = 1
    microbatches: int = 1
    recompute: str = "none"  # none | selective | full
    fused_kernels: bool = False
    fused_loss: bool = False
    compiled: bool = False
    cpu_optimizer: bool = False
    fused_optimizer: bool = False  # one fused AdamW kernel (GPUs) instead of torch's foreach (temporaries)
    dtype: str = "float32"  # compute dtype (parameters stay fp32: master weights)
    framework: str = "dtmega"  # whose implementation is costed (dtmega/cost/frameworks.py)
    tp_overlap: str = "none"  # none | async (torch's async TP) | userbuffers (Megatron's TP comm overlap)
    fp8: str | None = None  # the blocks' linears in FP8 with this scaling: delayed | tensorwise | rowwise
    fp8_param_gather: bool = False  # data-parallel gathers of the weights in FP8 (weights kept in FP8)
    recompute_layers: int | None = None  # full recompute of only this many blocks per stage (None: all)
    # Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding and the loss each
    # take a block's place, so a stage at either end holds one block fewer
    embedding_in_split: bool = False
    # packed documents with attention masked per document: their mean length in tokens (None: the
    # whole sequence attends causally); attention computes each document's own triangle
    document_length: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def fsdp_ranks(self) -> int:
        """Ranks each dense weight is sharded over (1 under DDP, Megatron's distributed optimizer,
        or one data rank)."""
        if self.dp_mode in ("ddp", "distributed-optimizer") or self.dp * self.cp == 1:
            return 1
        return (self.dp_shard if self.dp_mode == "hsdp" else self.dp) * self.cp

    @property
    def optimizer_ranks(self) -> int:
        """Ranks the fp32 master weights and Adam state are sharded over (ZeRO-1 and up)."""
        if self.dp_mode == "distributed-optimizer":
            return self.dp * self.cp
        return self.fsdp_ranks

    @property
    def wrapped(self) -> bool:
        """FSDP/DDP units exist (one data rank trains unwrapped, unless the optimizer is offloaded)."""
        return self.dp * self.cp > 1 or self.cpu_optimizer

    def with_(self, **changes) -> "PlanShape":
        return replace(self, **changes)

    def layers_per_rank(self, model: ModelShape, pp_rank: int | None = None) -> int:
        """Blocks on pipeline rank `pp_rank` (None: the busiest): an even split, or where the
        blocks do not divide, Megatron's uneven split (first and last stages take what the
        middle ones, ceil(layers / pp) each, leave; `dtmega plan` writes those flags). With the
        embedding and the loss counted in the split, (layers + 2) / pp slots per stage, the
        first and the last stage giving one to the embedding or the loss."""
        if self.embedding_in_split:
            per = math.ceil((model.layers + 2) / self.pp)
            if pp_rank is not None and pp_rank in (0, self.pp - 1):
                return per - 1
            return per
        per = math.ceil(model.layers / self.pp)
        if pp_rank is None or model.layers % self.pp == 0 or self.pp < 3:
            return per
        if pp_rank in (0, self.pp - 1):
            return (model.layers - (self.pp - 2) * per) // 2
        return per

    def attention_keys(self, seq: int) -> int:
        """The sequence length attention's work scales with: the documents' mean length when
        documents are masked, else the sequence."""
        return min(seq, self.document_length) if self.document_length else seq

    def describe(self) -> str:
        """One line: 'TP4+SP PP4x2 CP2(ring) FSDP16 EP1 mb1 recompute=full'."""
        parts = [f"TP{self.tp}" + ("+SP" if self.sp else "")]
        if self.pp > 1:
            parts.append(f"PP{self.pp}" + (f"x{self.vp}" if self.vp > 1 else "") + f"({self.schedule})")
        if self.cp > 1:
            parts.append(f"CP{self.cp}({self.cp_method})")
        mode = {"distributed-optimizer": "DISTOPT", "megatron-fsdp": "MFSDP"}.get(self.dp_mode, self.dp_mode.upper())
        parts.append(f"{mode}{self.dp}" + (f"/{self.dp_shard}" if self.dp_mode == "hsdp" else ""))
        if self.ep > 1:
            parts.append(f"EP{self.ep}" + ("(flex)" if self.dispatcher == "flex" else ""))
        parts.append(f"mb{self.micro_batch}x{self.microbatches}")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}"
                         + (f"({self.recompute_layers})" if self.recompute_layers is not None else ""))
        if self.fp8:
            parts.append(f"fp8={self.fp8}" + ("+gather" if self.fp8_param_gather else ""))
        if self.tp_overlap != "none":
            parts.append(f"tp-overlap={self.tp_overlap}")
        if self.cpu_optimizer:
            parts.append("cpu-optimizer")
        if self.document_length:
            parts.append(f"documents~{self.document_length}")
        if self.framework != "dtmega":
            parts.append(f"({self.framework})")
        return " ".join(parts)
