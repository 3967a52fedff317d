"""The pipeline section of `dtmega train`'s arguments: the size, the stages and the schedule."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from dtmega.passes import (
    Pass,
    PipelineSplit,
)
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class PipelineArgs:
    """Pipeline parallelism: the size, and how blocks split into stages and which schedule runs."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                                               "num_virtual_stages_per_pipeline_rank")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")

    pipeline_model_parallel_size: int = _opt(1, "PP size")
    pipeline_schedule: str | None = _opt(None, "pipeline schedule (default: 1f1b, or interleaved_1f1b with virtual stages)",
                                         ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                                          "zbv", "dualpipev"))
    num_layers_per_virtual_pipeline_stage: int | None = _opt(None, "blocks per virtual stage (interleaved schedules)")
    num_virtual_stages_per_pipeline_rank: int | None = _opt(None, "virtual stages per pipeline rank (interleaved "
                                                                  "schedules; the other way to say the same split, "
                                                                  "needed when the embedding or loss take a slot)")
    decoder_first_pipeline_num_layers: int | None = _opt(None, "blocks on the first pipeline stage (uneven split)")
    decoder_last_pipeline_num_layers: int | None = _opt(None, "blocks on the last pipeline stage (uneven split)")
    account_for_embedding_in_pipeline_split: bool = _opt(False, "the embedding takes one block's slot in the split")
    account_for_loss_in_pipeline_split: bool = _opt(False, "the output layer and loss take one block's slot")
    pipeline_model_parallel_layout: str | None = _opt(None, "explicit split, e.g. 'Et*3|t*4|t*4|t*3L'")

    def pipeline_passes(self, shape: Any, n_layers: int) -> list[Pass]:
        """PipelineSplit from Megatron's pipeline flags (micro-batches are the accumulation steps);
        none at PP 1, where any other pipeline flag is refused."""
        if shape.pp == 1:
            given = [f"--{f.name.replace('_', '-')}" for f in fields(PipelineArgs)
                     if f.name != "pipeline_model_parallel_size" and getattr(self, f.name)]
            if given:
                raise ArgumentError(f"pipeline options ({', '.join(given)}) need --pipeline-model-parallel-size > 1")
            return []
        virtual = 1
        if self.num_virtual_stages_per_pipeline_rank:
            if self.num_layers_per_virtual_pipeline_stage:
                raise ArgumentError("--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
                                    "both say how many virtual stages each rank runs. Fix: keep one")
            virtual = self.num_virtual_stages_per_pipeline_rank
        elif self.num_layers_per_virtual_pipeline_stage:
            per = self.num_layers_per_virtual_pipeline_stage
            if n_layers % (per * shape.pp):
                raise ArgumentError(
                    f"--num-layers {n_layers} is not divisible by --num-layers-per-virtual-pipeline-stage {per} x "
                    f"--pipeline-model-parallel-size {shape.pp}"
                )
            virtual = n_layers // (per * shape.pp)
        schedule = self.pipeline_schedule or ("interleaved_1f1b" if virtual > 1 else "1f1b")
        return [PipelineSplit(
            schedule=schedule, microbatches=shape.accumulation, virtual_stages=virtual,
            first_stage_layers=self.decoder_first_pipeline_num_layers,
            last_stage_layers=self.decoder_last_pipeline_num_layers,
            count_embedding=self.account_for_embedding_in_pipeline_split,
            count_loss=self.account_for_loss_in_pipeline_split, layout=self.pipeline_model_parallel_layout,
        )]
