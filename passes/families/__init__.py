"""Model families: what the compiler knows about a kind of model without editing it.

A family recognizes a model class, reads its shape facts (heads, vocab, blocks), carries the
built-in TP/SP rule sets, and knows how to call the model to get logits. dtmega's Llama,
torchtitan's llama3 and Hugging Face's LlamaForCausalLM are built in; a user registers
another with `register_family`.
"""

from __future__ import annotations

from torch import nn

from dtmega.passes.families.base import (  # noqa: F401  (the package's names)
    ModelFacts,
    ModelFamily,
    MoEFacts,
    default_logits,
    is_class,
    register_family,
    registered,
)


def family_of(model: nn.Module) -> ModelFamily | None:
    """The registered family that recognizes `model`, or None."""
    _load_builtin_families()
    for family in reversed(registered()):
        if family.matches(model):
            return family
    return None


def known_families() -> list[str]:
    """Names of the registered families."""
    _load_builtin_families()
    return [f.name for f in registered()]


def _load_builtin_families() -> None:
    from dtmega.passes.families import (  # noqa: F401
        hf_llama,
        hf_mixtral,
        torchtitan_llama,
        torchtitan_moe,
    )
