"""Tensor parallelism (Megatron's column/row-parallel linears, vocab-parallel embedding and
loss) as a pass."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtmega.passes.accounting import check_parameters_accounted
from dtmega.passes.base import Pass
from dtmega.passes.errors import PlanError
from dtmega.passes.program import Program
from dtmega.passes.results import TensorParallelism
from dtmega.passes.rules import Rule, resolve_rules
from dtmega.passes.tp_styles import apply_styles, retie_parameters, style


def check_head_divisibility(program: Program, axis: str, size: int) -> None:
    """The model-level constraints of sharding heads, vocab and MLP width over `size` ranks."""
    facts = program.facts
    checks = [
        ("n_heads", facts.n_heads, "each rank must hold whole attention heads"),
        ("n_kv_heads", facts.n_kv_heads, "each rank must hold whole key/value groups (Megatron "
                                         "replicates KV heads here; dtmega does not yet)"),
        ("ffn_dim", facts.ffn_dim, "the MLP's hidden width is split evenly"),
    ]
    for name, value, why in checks:
        if value % size:
            divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            raise PlanError(
                f"{name}={value} is not divisible by {axis}={size}: {why}. "
                f"Fix: use {axis} in {divisors}"
            )
    if facts.vocab_size % size:
        padded = -(-facts.vocab_size // size) * size
        raise PlanError(
            f"vocab_size={facts.vocab_size} is not divisible by {axis}={size}: the embedding and "
            f"output layer are split by vocabulary rows. Fix: pad the vocabulary to a multiple of "
            f"{size} (e.g. vocab_size={padded}; Megatron's --make-vocab-size-divisible-by does the "
            f"same) - the padded rows are never produced by the tokenizer"
        )


@dataclass
class TensorParallel(Pass):
    """Shards linears column-/row-wise, the embedding and output layer by vocabulary, and
    computes the loss on vocab-sharded logits so full logits are never gathered.

    `rules` extend or override the built-in rule set of the model's family (a rule with style
    'none' removes a module from TP); with `builtin_rules=False` only `rules` apply.
    `expert_hidden=False` leaves the experts' weights whole on this axis (Megatron's expert tensor
    parallelism 1), for ExpertParallel(fold=(axis,)) to spread over it.
    """

    axis: str = "tp"
    rules: list[Rule] = field(default_factory=list)
    builtin_rules: bool = True
    expert_hidden: bool = True  # split each expert's hidden dim (ETP = TP); False: ExpertParallel(fold=(axis,))

    provides = ("tensor_parallel@{axis}",)
    role = "tensor"

    def __post_init__(self) -> None:
        self.rules = [Rule.coerce(r) for r in self.rules]

    def annotate(self, program: Program) -> None:
        size = program.axis_size(self.axis)
        if program.family is not None and self.builtin_rules and program.facts.moe is not None \
                and not program.family.moe_tensor_parallel:
            raise PlanError(
                f"TensorParallel does not shard the mixture-of-experts layers of {program.family.name} models yet "
                "(dtmega's own MoE models support it). Fix: parallelize them with ExpertParallel and DataParallel"
            )
        defaults = list(program.family.tp_rules) if (program.family and self.builtin_rules) else []
        if not self.expert_hidden:  # the experts stay whole here: ExpertParallel folds them over this axis
            defaults = [rule for rule in defaults if rule.style != "expert_hidden"]
        if not defaults and not self.rules:
            program.facts  # raises the "no rule set knows this model" error
            raise PlanError("TensorParallel has no rules: pass rules=[Rule(pattern, style), ...]")
        if program.family is not None and self.builtin_rules:
            check_head_divisibility(program, self.axis, size)
        chosen, unmatched = resolve_rules(program.modules, defaults, self.rules)
        if unmatched:
            names = ", ".join(f"Rule({r.pattern!r}, {r.style!r})" for r in unmatched)
            raise PlanError(
                f"TensorParallel rule(s) {names} match no module of {type(program.model).__name__}. "
                "Fix: correct the pattern (module FQNs look like 'layers.0.attention.wq'; '*' is one "
                "component, '**' any number)"
            )
        if not chosen:
            raise PlanError(f"TensorParallel found nothing to shard in {type(program.model).__name__}; give rules=[...]")
        for fqn, rule in chosen.items():
            entry = program.layout[fqn]
            entry.style = rule.style
            style(rule.style, "tensor_parallel").annotate(
                entry, program.modules[fqn], self.axis, size, dict(rule.options)
            )
        program.record(TensorParallelism(self.axis, size))
        program.note(f"TensorParallel({self.axis}={size}): {len(chosen)} modules sharded")

    def finalize(self, program: Program) -> None:
        """Every parameter where activations are sharded over the axis (this pass's heads and
        hidden units, sequence parallelism's positions) is covered by a style: passes/accounting.py."""
        check_parameters_accounted(program, self.axis, "TensorParallel")

    def apply(self, program: Program) -> None:
        count = apply_styles(program, "tensor_parallel", self.axis)
        retie_parameters(program)
        program.note(f"TensorParallel: materialized {count} modules")
