"""The Hugging Face architectures dtmega reads and writes, one entry each: which dtmega model
stands for it, how its config.json maps to that model's config and back, and where each weight
lives (`source` for the sharded reader, `tensors` for the exporter).

`architecture_of(config.json)` picks the entry from `architectures`; `architecture_of_family`
from a dtmega model family (export). A new architecture is one entry in `_ARCHITECTURES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dtmega.models.llama.hf_config import ARCHITECTURES as LLAMA_ARCHITECTURES
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.llama.hf_names import WeightSource


@dataclass(frozen=True)
class HFArchitecture:
    """One Hugging Face architecture as a dtmega model family."""

    names: tuple[str, ...]  # config.json's `architectures` values
    model: str  # the dtmega model spec a loaded checkpoint records (its config is the checkpoint's)
    family: str  # dtmega's model family (ModelSpec.family)
    config_from_hf: Callable[[dict, str], Any]
    hf_config: Callable[[Any, dict | None, str], dict]  # (config, base config.json, dtype) -> config.json
    source: Callable[[str, Any, set[str], dict], WeightSource]  # (dtmega name, config, HF names, config.json)
    tensors: Callable[[str, torch.Tensor, Any], dict[str, torch.Tensor]]  # export of one full tensor
    harmless: Callable[[str, Any], bool]  # an HF tensor the model may leave unread

    def build(self, config: Any) -> torch.nn.Module:
        """The dtmega model of `config` (on whatever device is current)."""
        from dtmega.models import model_spec

        return model_spec(self.model).build(config)


def _llama() -> HFArchitecture:
    from dtmega.models.llama.hf_config import hf_config_from_llama, llama_config_from_hf
    from dtmega.models.llama.hf_names import hf_source, hf_tensors

    def harmless(name: str, config) -> bool:  # older checkpoints' RoPE tables; a tied lm_head
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_embeddings)

    return HFArchitecture(tuple(LLAMA_ARCHITECTURES), "llama", "dtmega-llama", llama_config_from_hf,
                          hf_config_from_llama, lambda name, config, names, hf: hf_source(name, config, names),
                          hf_tensors, harmless)


def _deepseek() -> HFArchitecture:
    from dtmega.models.deepseek.hf_config import ARCHITECTURE, deepseek_config_from_hf, hf_config_from_deepseek
    from dtmega.models.deepseek.hf_names import hf_source, hf_tensors, mtp_copies

    def source(name: str, config, names: set[str], hf: dict) -> WeightSource:
        return hf_source(name, config, names, bool(hf.get("rope_interleave", True)))

    def harmless(name: str, config) -> bool:  # the MTP layers' copies of the shared embedding and head
        copies = mtp_copies(config)
        return name in copies["tok_embeddings.weight"] or name in copies["output.weight"] or (
            name == "lm_head.weight" and config.tie_embeddings) or name.endswith("rotary_emb.inv_freq")

    return HFArchitecture((ARCHITECTURE,), "deepseek-v3", "dtmega-deepseek", deepseek_config_from_hf,
                          hf_config_from_deepseek, source, hf_tensors, harmless)


_ARCHITECTURES: tuple[Callable[[], HFArchitecture], ...] = (_llama, _deepseek)


def known_architectures() -> list[HFArchitecture]:
    """Every architecture dtmega reads and writes."""
    return [make() for make in _ARCHITECTURES]


def architecture_of(hf_config: dict, source: str = "config.json") -> HFArchitecture:
    """The entry for a config.json, by its `architectures`; an HFFormatError naming what dtmega
    reads otherwise."""
    named = hf_config.get("architectures") or []
    known = known_architectures()
    for architecture in known:
        if len(named) == 1 and named[0] in architecture.names:
            return architecture
    every = [name for architecture in known for name in architecture.names]
    raise HFFormatError(f"{source}: architectures = {named!r} is not supported: dtmega reads {', '.join(every)}. "
                        "Fix: convert a model of those architectures")


def architecture_of_family(family: str, what: str) -> HFArchitecture:
    """The entry that writes dtmega's model family `family` (export); `what` names the source."""
    for architecture in known_architectures():
        if architecture.family == family:
            return architecture
    families = ", ".join(a.family for a in known_architectures())
    raise HFFormatError(f"{what} holds a {family} model; dtmega exports its own families ({families}) to Hugging Face")
