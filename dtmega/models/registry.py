"""Model specs: every model `dtmega train --model NAME`, `evaluate`, `generate` and the plan
simulator can build, by name.

A spec pairs a config object of a named size with how to build the model from it, its FLOPs
per token, how to change its vocabulary and how to save and read its config. dtmega's Llama
registers its sizes (debug, llama3-8b/70b/405b, the MoE presets); a Hugging Face or torchtitan
model registers from user code in a few lines (docs/architecture.md, "Models") and is then
reachable with `dtmega train --custom-import my_models --model my-model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dtmega.kernels.errors import DtmegaError


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its config and everything the trainer needs to build and account for it."""

    name: str
    family: str  # the passes' model family (dtmega-llama, hf-llama, torchtitan-llama3, ...)
    config: Any
    build: Callable[[Any], nn.Module]  # config -> the unsharded model, on the current default device
    flops_per_token: Callable[[Any, int], float]  # (config, seq_len) -> training FLOPs per token
    with_vocab: Callable[[Any, int], Any]  # (config, vocab_size) -> the config with that vocabulary
    config_to_dict: Callable[[Any], dict]
    config_from_dict: Callable[[dict], Any]
    # How the weights come to exist: "meta" = built on the meta device, then `init_weights(seed)`
    # after sharding (sharding-invariant); "seeded" = built on the CPU under torch.manual_seed(seed)
    # on every rank (the same values everywhere), then sharded.
    materialize: str = "meta"
    # Whether Megatron's size flags (--num-layers, --hidden-size, ...) describe this model.
    size_flags: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.materialize not in ("meta", "seeded"):
            raise DtmegaError(f"ModelSpec(materialize={self.materialize!r}): use 'meta' or 'seeded'")

    def instantiate(self, config: Any, seed: int) -> nn.Module:
        """The unsharded model to parallelize: on the meta device, or materialized under `seed`."""
        if self.materialize == "meta":
            with torch.device("meta"):
                return self.build(config)
        torch.manual_seed(seed)
        with torch.device("cpu"):
            return self.build(config)


_MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Makes `spec` buildable by name; registering a taken name needs `replace=True`."""
    if spec.name in _MODELS and not replace and _MODELS[spec.name] is not spec:
        raise DtmegaError(f"a model named {spec.name!r} is registered already; pass replace=True to replace it")
    _MODELS[spec.name] = spec
    return spec


def model_spec(name: str) -> ModelSpec:
    """The registered model `name`; KeyError naming the known ones and the fix otherwise."""
    if name not in _MODELS:
        raise KeyError(
            f"no model named {name!r}; registered: {', '.join(model_names())}. A model of your own registers "
            "with dtmega.models.register_model in a module you pass with --custom-import"
        )
    return _MODELS[name]


def model_names() -> list[str]:
    """Names of every registered model, in registration order."""
    return list(_MODELS)


def count_parameters(model: nn.Module) -> int:
    """Parameters of a (possibly meta) model, shared ones once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
