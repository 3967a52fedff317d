"""A model family: everything dtmega knows about one kind of model, in one object registered once.

A family folder (dtmega/models/<name>/) builds one `Family` and calls `register_model_family`
in its `__init__.py`. The object carries

- `sizes`: its named sizes (`ModelSpec`: config, builder, FLOPs, config (de)serialization);
- `passes`: what the passes know (`ModelFamily`: shape facts with head_dim, TP/SP/EP rules,
  attention core, fusion sites, logits, runtime hooks);
- `hf`: its Hugging Face architecture (config.json both ways, where every weight lives);
- `megatron`: which of Megatron's flags select and size it;
- `multi_token_prediction`: whether it has Megatron's MTP depths (--mtp-num-layers).

Interop (`dtmega.interop.hf_architectures`), the trainer (`dtmega.train.prepare`,
`dtmega.train.not_built`), the planner and the passes ask the family; none branches on a
family's name (tests/unit/test_model_layer.py holds them to it). Torchtitan's
`models/<name>/` + `TrainSpec` and Megatron-Core's `ModuleSpec` are the models for this;
our `annotate` and layout IR stay as they are, in `passes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from dtmega.kernels.errors import DtmegaError
from dtmega.models.registry import ModelSpec, register_model
from dtmega.passes.families import ModelFamily, register_family

if TYPE_CHECKING:
    from dtmega.models.llama.hf_names import WeightSource


@dataclass(frozen=True)
class HFArchitecture:
    """One Hugging Face architecture as a dtmega model family: how its config.json maps to the
    family's config and back, and where each weight lives (`source` for the sharded reader,
    `tensors` for the exporter)."""

    names: tuple[str, ...]  # config.json's `architectures` values
    model: str  # the dtmega model spec a loaded checkpoint records (its config is the checkpoint's)
    family: str  # dtmega's model family (ModelSpec.family)
    config_from_hf: Callable[[dict, str], Any]
    hf_config: Callable[[Any, dict | None, str], dict]  # (config, base config.json, dtype) -> config.json
    source: Callable[[str, Any, set[str], dict], "WeightSource"]  # (dtmega name, config, HF names, config.json)
    tensors: Callable[[str, torch.Tensor, Any], dict[str, torch.Tensor]]  # export of one full tensor
    harmless: Callable[[str, Any], bool]  # an HF tensor the model may leave unread

    def build(self, config: Any) -> torch.nn.Module:
        """The dtmega model of `config` (on whatever device is current)."""
        from dtmega.models.registry import model_spec

        return model_spec(self.model).build(config)


@dataclass(frozen=True)
class MegatronSizing:
    """How Megatron's model flags describe a family: `selects(args)` says whether the flags
    describe this family's model (e.g. --multi-latent-attention, --qk-layernorm), `config(args,
    tokenizer_vocab)` builds its config from the size flags, `adjust(config, args, source)` applies
    the flags a model of fixed sizes (a named size, an HF checkpoint: `source` names it) of the
    family still takes (None: none). `model` is the spec a model sized
    by flags records; `flag` the flag that selects the family (for messages; "" for the default)."""

    model: str
    selects: Callable[[Any], bool]
    config: Callable[[Any, int], Any]
    adjust: Callable[[Any, Any, str], Any] | None = None
    flag: str = ""


@dataclass(frozen=True)
class Family:
    """Everything dtmega knows about one kind of model (see the module docstring)."""

    name: str  # the passes' family name, = ModelSpec.family of its sizes
    passes: ModelFamily
    sizes: tuple[ModelSpec, ...]
    hf: tuple[HFArchitecture, ...] = ()
    megatron: MegatronSizing | None = None
    multi_token_prediction: bool = False
    kv_cache: bool = False  # whether its blocks fill a KVCache (dtmega generate / serve decode it)
    description: str = ""

    def __post_init__(self) -> None:
        wrong = [spec.name for spec in self.sizes if spec.family != self.name]
        if self.passes.name != self.name or wrong:
            raise DtmegaError(f"family {self.name!r}: its passes family ({self.passes.name!r}) and every size's family "
                              f"({', '.join(wrong) or 'fine'}) must carry its name")


_FAMILIES: dict[str, Family] = {}


def register_model_family(family: Family) -> Family:
    """Registers a family once: its sizes (by name), its passes family, its HF architectures and
    Megatron flags. A later registration of the same name replaces it (a user's override)."""
    register_family(family.passes)
    for spec in family.sizes:
        register_model(spec, replace=True)
    _FAMILIES.pop(family.name, None)
    _FAMILIES[family.name] = family
    return family


def model_families() -> list[Family]:
    """Every registered family, oldest first (dtmega's own, registered by importing
    `dtmega.models`, which callers do: Llama, Qwen3, DeepSeek)."""
    return list(_FAMILIES.values())


def model_family(name: str) -> Family | None:
    """The registered family `name` (a ModelSpec.family), or None for a family registered only
    with the passes (a user's model: `register_family` + `register_model`)."""
    return next((family for family in model_families() if family.name == name), None)


def family_for_flags(args: Any) -> Family:
    """The family Megatron's flags describe: the newest registered family whose sizing selects
    them (DeepSeek's --multi-latent-attention, Qwen3's --qk-layernorm), else the oldest (Llama)."""
    sized = [family for family in model_families() if family.megatron is not None]
    for family in reversed(sized):
        if family.megatron.selects(args):
            return family
    return sized[0]
