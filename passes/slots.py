"""Swapping the module in a slot of the model: how a pass changes how an op runs without touching
any forward.

`swap_module(program, fqn, make)` replaces the module at `fqn` in every part of the program (the
model, or this rank's pipeline stages) by `make(old)`, which must hold exactly the old module's
parameters (the same Parameter objects: nothing dropped, nothing new), and moves the old
module's forward hooks to it (a tensor-parallel or sequence-parallel style installed on the slot
keeps working). The model's own forward then calls the new module where it called the old one.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from dtmega.passes.errors import PlanError

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def parameter_ids(module: nn.Module) -> set[int]:
    """Identities of every parameter of `module` and its children."""
    return {id(p) for p in module.parameters()}


def swap_module(program, fqn: str, make: Callable[[nn.Module], nn.Module], why: str) -> int:
    """Replaces the module at `fqn` by `make(old)` in every part; returns how many were swapped.
    PlanError (naming `why`, the pass's decision) if the new module would drop or add a parameter."""
    parent_fqn, _, name = fqn.rpartition(".")
    count = 0
    for parent in program.modules_at(parent_fqn):
        old = getattr(parent, name, None)
        if old is None:  # a pipeline stage without this slot (the final norm on an earlier stage)
            continue
        new = make(old)
        if parameter_ids(new) != parameter_ids(old):
            lost = sorted(n for n, p in old.named_parameters() if id(p) not in parameter_ids(new))
            raise PlanError(f"{why}: the module it would put at {fqn} does not hold {type(old).__name__}'s parameters "
                            f"({', '.join(lost) or 'it holds others'}); a swap never drops or adds one")
        for hooks in _HOOK_DICTS:
            getattr(new, hooks).update(getattr(old, hooks))
        setattr(parent, name, new)
        count += 1
    return count


def refuse_dropping_cores(program, cores: list[str], why: str, fix: str) -> None:
    """PlanError when any attention core at `cores` drops attention probabilities in training
    (`attention_dropout_p` > 0, as the GPT family's core does): a pass that would replace such a
    core with a kernel that computes no dropout says so instead of silently training without it."""
    dropping = [fqn for fqn in cores if float(getattr(program.modules.get(fqn), "attention_dropout_p", 0.0) or 0.0) > 0]
    if dropping:
        p = program.modules[dropping[0]].attention_dropout_p
        raise PlanError(f"{why}: {len(dropping)} attention cores ({dropping[0]}, ...) drop attention probabilities in "
                        f"training (p={p}), which that attention does not compute. Fix: {fix}")
