"""The Hugging Face architectures dtmega reads and writes: each registered model family's
(dtmega/models/family.py, `Family.hf`), nothing listed here.

`architecture_of(config.json)` picks the entry from `architectures`; `architecture_of_family`
the one that writes a dtmega model family's config (export). A new architecture is an entry in
its family's folder (dtmega/models/<family>/hf_architecture.py).
"""

from __future__ import annotations

from dtmega.models import HFArchitecture, model_families
from dtmega.models.llama.hf_config import HFFormatError

__all__ = ["HFArchitecture", "architecture_of", "architecture_of_family", "known_architectures"]


def known_architectures() -> list[HFArchitecture]:
    """Every architecture dtmega reads and writes (every registered family's)."""
    return [architecture for family in model_families() for architecture in family.hf]


def architecture_of(hf_config: dict, source: str = "config.json") -> HFArchitecture:
    """The entry for a config.json, by its `architectures`; an HFFormatError naming what dtmega
    reads otherwise."""
    if not isinstance(hf_config, dict):
        raise HFFormatError(f"{source} holds a {type(hf_config).__name__}, not a JSON object. Fix: the model's "
                            "own config.json")
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
