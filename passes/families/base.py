"""What a model family is: the facts, rule sets and hooks the passes use (registered by
families/*.py, dtmega's models and users; looked up through `dtmega.passes.families`)."""


from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dtmega.passes.rules import Rule


@dataclass(frozen=True)
class MoEFacts:
    """Where a model's mixture-of-experts layers are and what they hold."""

    layers: tuple[str, ...]  # FQNs of the MoE feed-forward modules
    num_experts: int
    top_k: int
    router: str  # FQN of the router, relative to an MoE module
    experts: str  # FQN of the module holding the expert weights, relative to an MoE module
    expert_params: tuple[str, ...]  # its [num_experts, ...] parameters
    shared_experts: str | None = None
    capacity_factor: float | None = None  # tokens dropped per sequence above capacity (None: dropless)
    num_groups: int | None = None  # group-limited routing: experts in this many equal consecutive groups
    group_topk: int | None = None  # ... of which a token uses its best group_topk

    def experts_at(self, layer: str) -> str:
        """FQN of the experts module of MoE layer `layer`."""
        return f"{layer}.{self.experts}"


@dataclass(frozen=True)
class LatentAttentionFacts:
    """Multi-latent attention's sizes (DeepSeek): what the cost model counts instead of GQA's."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelFacts:
    """Shape facts every pass may check constraints against."""

    family: str
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    dim: int
    ffn_dim: int
    blocks: tuple[str, ...]
    embedding: str
    output: str
    final_norm: str
    tied_embeddings: bool = False
    moe: MoEFacts | None = None
    max_positions: int | None = None  # the longest sequence the position table covers (None: unknown)
    latent_attention: LatentAttentionFacts | None = None  # MLA instead of grouped-query attention
    mtp_layers: int = 0  # multi-token-prediction depths (each one more block beside `blocks`)
    # Modules that live beside the output layer (on the last pipeline stage), e.g. DeepSeek's
    # multi-token prediction `mtp`, and the blocks inside them: every pass that treats each block
    # (context parallelism's attention cores, recompute, compile, FSDP units, document masks)
    # treats these too (`Program.blocks()`); pipeline splitting keeps them with the output.
    head_modules: tuple[str, ...] = ()
    head_blocks: tuple[str, ...] = ()
    # Width of one attention head (query/key); 0 = dim / n_heads. Qwen3's and Megatron's
    # --kv-channels make it independent of the width.
    head_dim: int = 0
    # The GPT family's GPTConfig (dtmega/models/gpt/config.py): what Megatron's GPT blocks add to a
    # Llama block's shapes (biases, LayerNorm, a two-matrix MLP, learned positions, dropout), for the
    # cost model's counts and activation bytes. None for Llama-shaped families.
    gpt_block: object | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // max(1, self.n_heads))

    @property
    def n_layers(self) -> int:
        """Number of transformer blocks."""
        return len(self.blocks)


def default_logits(module: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Calls `module(tokens)` and unwraps `.logits` if the model returns an output object."""
    out = module(tokens)
    return getattr(out, "logits", out)


@dataclass(frozen=True)
class ModelFamily:
    """A kind of model the passes know how to shard without edits."""

    name: str
    matches: Callable[[nn.Module], bool]
    describe: Callable[[nn.Module], ModelFacts]
    tp_rules: tuple[Rule, ...]
    sp_rules: tuple[Rule, ...]
    logits: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor] = default_logits
    attention_core: str | None = None  # FQN of the attention-core module, relative to a block
    position_kwarg: str = "position_ids"  # how a pipeline stage's forward takes position ids
    # How the model's forward (and `logits`, as a keyword) takes per-token document ids of packed
    # sequences (attention masked per document: passes/document_masking.py); None: not supported.
    document_kwarg: str | None = None
    # The model masks packed documents by itself when its position ids restart per document
    # (transformers >= 4.53 finds packed sequences in position_ids); used where document_kwarg is None.
    documents_by_positions: bool = False
    # Whether `logits` also takes the batch's `labels` and `loss_mask` (keywords), for losses the
    # model computes itself beside the next-token one (DeepSeek's multi-token prediction).
    loss_inputs: bool = False
    # With `loss_inputs`: more keyword inputs the model takes from the batch's fields (e.g.
    # DeepSeek's rolled multi-token-prediction inputs), Batch -> {kwarg: tensor}.
    model_inputs: Callable | None = None
    # For a family whose own attention cores take no document ids: makes the core DocumentMasking
    # installs at `attention_core` (given the backend), which reads the ids `document_kwarg` passes.
    document_core: Callable[[str], nn.Module] | None = None
    # Installs a token dispatcher (dtmega.kernels.moe_dispatch) into one MoE module: how expert
    # parallelism reaches the family's MoE code without editing it. None: no MoE support.
    install_dispatcher: Callable[[nn.Module, object], None] | None = None
    # Whether the family's MoE layers run under tensor parallelism (experts sharded on their
    # hidden dim, Megatron's expert tensor parallelism = TP).
    moe_tensor_parallel: bool = False
    # Run-time hooks the family's own layers need in every step (e.g. dtmega's MoE balancing
    # losses and expert bias), given the applied program; see passes/runtime.py.
    runtime_hooks: Callable[[object], list] | None = None
    # Where the model's fusable slot modules are, {op: [module FQNs]} (passes/fusion_sites.py):
    # what FuseKernels may swap for fused kernels. None: only the loss is fused.
    fusion_sites: Callable[[nn.Module], dict[str, list[str]]] | None = None


_FAMILIES: list[ModelFamily] = []


def register_family(family: ModelFamily) -> ModelFamily:
    """Makes `family` known to every pass; a later registration of the same name replaces it."""
    _FAMILIES[:] = [f for f in _FAMILIES if f.name != family.name]
    _FAMILIES.append(family)
    return family


def is_class(model: nn.Module, module_prefix: str, class_name: str) -> bool:
    """Class test by name, so a family never imports the library it describes."""
    return any(
        cls.__name__ == class_name and cls.__module__.startswith(module_prefix) for cls in type(model).__mro__
    )


def registered() -> list[ModelFamily]:
    """The families registered so far, oldest first."""
    return list(_FAMILIES)
