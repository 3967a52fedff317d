"""No pass silently replaces another's layout decision (issue 47, item 4).

Before: a pass that made only the later blocks FSDP units came out fully sharded (DataParallel
wrote `wrap` on every block), and FuseKernels overwrote the loss another pass chose for the
output layer, with no error. Now DataParallel keeps the units another pass chose (or refuses,
naming both passes and the module, where they disagree), and the PassManager records which pass
made each decision and refuses a later pass that changes it, unless that pass declares it
refines the other's layout (SequenceParallel refining TensorParallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import (
    DataParallel,
    FuseKernels,
    Pass,
    PassManager,
    Plan,
    PlanError,
    Program,
    SequenceParallel,
    TensorParallel,
)
from tests.user_passes import LaterBlocksAsUnits, TokenWeightedLoss


@dataclass
class ReshardW1(Pass):
    """Shards w1's weight on the other dim than TensorParallel chose (a conflicting decision)."""

    refine: bool = False

    def mesh_axes(self) -> tuple[str, ...]:
        return ()

    def annotate(self, program: Program) -> None:
        program.layout["layers.0.feed_forward.w1"].params["weight"].placements["tp"] = "S(1)"

    def apply(self, program: Program) -> None:
        pass


@dataclass
class RefiningReshardW1(ReshardW1):
    """The same change, declared as a refinement of tensor parallelism's layout."""

    refines = ("tensor_parallel@*",)


@dataclass
class DropStyles(Pass):
    """Takes TensorParallel's style off w1 (removing a decision is changing it)."""

    def mesh_axes(self) -> tuple[str, ...]:
        return ()

    def annotate(self, program: Program) -> None:
        program.layout["layers.0.feed_forward.w1"].style = None

    def apply(self, program: Program) -> None:
        pass


def _model() -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig.from_name("debug"))


def test_data_parallel_keeps_the_units_another_pass_chose():
    layout = dtmega.check_plan(_model(), {"dp_shard": 2}, Plan([LaterBlocksAsUnits(first=2), DataParallel("fsdp")]))
    units = {fqn: entry.wrap for fqn, entry in layout.modules.items() if entry.wrap}
    assert units == {"": "fsdp", "layers.2": "fsdp", "layers.3": "fsdp"}  # before: every block was a unit
    # the earlier blocks' weights are sharded by the root's unit, as the layout says
    assert layout["layers.0.feed_forward.w1"].params["weight"].placements == {"dp_shard": "S(0)"}


def test_units_chosen_on_one_data_parallel_rank_are_built_too():
    """With one data-parallel rank DataParallel builds no units of its own; the ones another
    pass chose are built all the same (before: the one-rank shortcut dropped them)."""
    layout = dtmega.check_plan(_model(), {"tp": 2}, Plan([TensorParallel(), LaterBlocksAsUnits(first=3),
                                                          DataParallel("fsdp")]))
    assert {fqn for fqn, entry in layout.modules.items() if entry.wrap} == {"", "layers.3"}


def test_units_of_another_mode_are_refused_naming_both_passes_and_the_module():
    with pytest.raises(PlanError) as caught:
        dtmega.check_plan(_model(), {"dp_shard": 2}, Plan([LaterBlocksAsUnits(mode="ddp"), DataParallel("fsdp")]))
    message = str(caught.value)
    assert "LaterBlocksAsUnits made layers.1 a 'ddp' data-parallel unit" in message
    assert "DataParallel(mode='fsdp')" in message and "Fix: DataParallel(mode='ddp')" in message


def test_units_chosen_twice_are_refused():
    with pytest.raises(PlanError, match=r"LaterBlocksAsUnits chose the data-parallel units \(layers.1, ...\) and "
                                        r"DataParallel\(blocks='layers.\*'\) chooses them too. Fix: leave blocks unset"):
        dtmega.check_plan(_model(), {"dp_shard": 2}, Plan([LaterBlocksAsUnits(), DataParallel("fsdp", blocks="layers.*")]))


def test_a_pass_that_overwrites_another_pass_s_decision_is_refused_by_name():
    """FuseKernels' fused loss used to replace the token-weighted loss silently (the weights were ignored)."""
    with pytest.raises(PlanError) as caught:
        dtmega.check_plan(_model(), {"dp_shard": 2}, Plan([TokenWeightedLoss(), FuseKernels(cross_entropy=True),
                                                           DataParallel()]))
    message = str(caught.value)
    assert message.startswith("FuseKernels changes output.kernel from 'cross_entropy.token_weighted' to "
                              "'cross_entropy.fused_linear.")
    assert "which TokenWeightedLoss decided" in message and "Fix: drop one of TokenWeightedLoss and FuseKernels" in message
    assert "\n" not in message


def test_placements_and_removed_decisions_are_decisions_too():
    with pytest.raises(PlanError, match=r"ReshardW1 changes layers.0.feed_forward.w1.params.weight\[tp\] from 'S\(0\)' "
                                        r"to 'S\(1\)', which TensorParallel decided.*refines = \('tensor_parallel@tp',\)"):
        dtmega.check_plan(_model(), {"tp": 2}, Plan([TensorParallel(), ReshardW1()]))
    with pytest.raises(PlanError, match=r"DropStyles changes layers.0.feed_forward.w1.style from 'colwise' away"):
        dtmega.check_plan(_model(), {"tp": 2}, Plan([TensorParallel(), DropStyles()]))


def test_a_declared_refinement_is_not_an_overwrite():
    """SequenceParallel declares it refines TensorParallel's layout (its all-reduces become
    reduce-scatters); a pass of one's own may declare the same, and then owns what it changed."""
    program = Program.build(_model(), {"tp": 2})
    PassManager([TensorParallel(), SequenceParallel()]).annotate(program)
    assert program.layout["layers.0.feed_forward.w2"].outputs["tp"] == "P->S(1)"
    assert program.decided_by("layers.0.feed_forward.w2", "outputs[tp]") == "SequenceParallel"
    assert program.decided_by("layers.0.feed_forward.w2", "style") == "TensorParallel"
    assert program.decided_by("layers.0.attention", "wrap") is None
    layout = dtmega.check_plan(_model(), {"tp": 2}, Plan([TensorParallel(), RefiningReshardW1()]))
    assert layout["layers.0.feed_forward.w1"].params["weight"].placements["tp"] == "S(1)"
