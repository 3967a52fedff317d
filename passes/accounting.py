"""Every parameter accounted for: a tensor- or sequence-parallel plan says, for every parameter of
the region it shards, what happens to it.

A module whose style shards its output over an axis (a column-wise linear: this rank's heads or
hidden units; a sequence-parallel norm: this rank's positions) opens a region: everything its
parent computes next sees sharded activations until a style gathers or reduces them. A parameter
in such a region is right only if a style covers its module: sharded (column-/row-wise, vocab,
experts), replicated with its gradient summed over the axis (a per-head norm's `head_norm`, a
sequence-sharded norm's `sequence_norm`), or replicated because its own activations are whole
(`replicate`, said by a rule, not left to chance). A parameter no style covers would get this
rank's partial gradient and drift from the other ranks' copies, silently; it is refused before
launch, named with the fix.
"""

from __future__ import annotations

from dtmega.passes.errors import PlanError


def unaccounted_parameters(program, axis: str) -> list[str]:
    """Names of the parameters inside a region sharded over `axis` whose module no style covers.
    A sequence-sharded region ends where a module gathers its input over the axis (attention and
    MLPs under sequence parallelism see whole sequences)."""
    from dtmega.passes.tp_styles import STYLES

    regions = []  # (parent FQN, the gathered subtrees that leave it: sequence regions only)
    for fqn, entry in program.layout.modules.items():
        if entry.style in STYLES and STYLES[entry.style].opens_region and _on_axis(entry, axis):
            parent = fqn.rpartition(".")[0]
            sequence = STYLES[entry.style].owner == "sequence_parallel"
            gathered = [other for other, e in program.layout.modules.items()
                        if sequence and "->R" in str(e.inputs.get(axis, "")) and _within(other, parent)]
            regions.append((parent, gathered))
    if not regions:
        return []
    missing = []
    for fqn in program.modules:
        entry = program.layout[fqn]
        if entry.style is not None or not entry.params:
            continue
        if any(_within(fqn, parent) and not any(_within(fqn, g) for g in gathered) for parent, gathered in regions):
            missing += [f"{fqn}.{name}" if fqn else name for name in entry.params]
    return missing


def _within(fqn: str, root: str) -> bool:
    return root == "" or fqn == root or fqn.startswith(root + ".")


def _on_axis(entry, axis: str) -> bool:
    return axis in entry.outputs or axis in entry.inputs or any(axis in p.placements for p in entry.params.values())


def check_parameters_accounted(program, axis: str, owner: str) -> None:
    """PlanError naming every parameter of a sharded region that no style covers, and the fix."""
    missing = unaccounted_parameters(program, axis)
    if not missing:
        return
    shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    module = missing[0].rpartition(".")[0]
    raise PlanError(
        f"{owner}: {shown} lie(s) where activations are sharded over {axis!r}, but no rule says how: each rank "
        f"would update its own copy with a partial gradient. Fix: a rule for the module, e.g. "
        f"Rule({module!r}, 'head_norm') for a per-head norm on sharded heads, Rule({module!r}, 'colwise'/'rowwise') "
        f"to shard it, or Rule({module!r}, 'replicate') if its own inputs are whole on every rank"
    )
