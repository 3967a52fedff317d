"""Pipeline parallelism against the unsharded model (an 8-block Llama): every schedule at pp=2
and pp=4, compositions with TP/SP/FSDP/DDP/recompute, uneven splits; loss, every gradient,
5 AdamW steps (tolerances in tests/helpers.py: 1e-5 relative, fp32)."""

from __future__ import annotations

import pytest

import dtmega
from dtmega.passes import DataParallel, PipelineSplit, PipelineStages, Recompute, SequenceParallel, TensorParallel
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama, first_copy_mesh

SCHEDULES = {  # schedule -> virtual stages per rank
    "gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zero_bubble": 2, "zbv": 2, "dualpipev": 2,
}


def run(sizes: dict, passes: list, batch_size: int = 8, seed: int = 1):
    reference, meta_copy = build_dtmega_llama(debug_llama(n_layers=8), seed=seed)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(**sizes), dtmega.Plan(passes))
    pm.init_weights(seed=seed)
    assert_close_to_reference(compare_training(reference, pm, steps=5, batch_size=batch_size))
    return pm


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_matches_unsharded(schedule, pp):
    v = SCHEDULES[schedule]
    microbatches = 2 * pp * v
    pm = run(dict(pp=pp), [PipelineSplit(schedule=schedule, virtual_stages=v, microbatches=microbatches)],
             batch_size=microbatches)
    stages = pm.executor.local_stages
    assert len(stages) == v
    assert {e.stage for e in pm.layout.modules.values() if e.stage is not None} == set(range(pp * v))


@pytest.mark.parametrize(
    "name, sizes, passes",
    [
        ("pp2_tp2", dict(pp=2, tp=2), [TensorParallel(), PipelineSplit(microbatches=4)]),
        ("pp2_tp2_sp_interleaved", dict(pp=2, tp=2),
         [TensorParallel(), SequenceParallel(), PipelineSplit("pp", "interleaved_1f1b", 4, virtual_stages=2)]),
        ("pp2_fsdp2", dict(pp=2, dp_shard=2), [PipelineSplit(microbatches=4), DataParallel("fsdp")]),
        ("pp2_zbv_fsdp2", dict(pp=2, dp_shard=2), [PipelineSplit("pp", "zbv", 4, virtual_stages=2), DataParallel("fsdp")]),
        ("pp2_recompute_ddp2", dict(pp=2, dp_replicate=2), [PipelineSplit(microbatches=2), Recompute("full"),
            DataParallel("ddp")]),
        ("pp2_uneven_first", dict(pp=2), [PipelineSplit("pp", "gpipe", 2, first_stage_layers=3)]),
        ("pp4_uneven_first_last", dict(pp=4), [PipelineSplit(microbatches=4, first_stage_layers=1, last_stage_layers=1)]),
        ("pp4_layout_string", dict(pp=4), [PipelineSplit(microbatches=4, layout="Et|t*3|t*3|tL")]),
        ("pp2_embedding_and_loss_counted", dict(pp=2), [PipelineSplit(microbatches=2, count_embedding=True, count_loss=True)]),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_compositions_and_uneven_splits(name, sizes, passes):
    run(sizes, passes)


def test_uneven_split_places_blocks_as_asked():
    pm = run(dict(pp=4), [PipelineSplit(microbatches=4, first_stage_layers=1, last_stage_layers=1)])
    assert [len(b) for b in pm.result(PipelineStages).blocks] == [1, 3, 3, 1]


def test_schedule_table_shows_every_micro_batch():
    reference, meta_copy = build_dtmega_llama(debug_llama(n_layers=8), seed=1)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(pp=2), [PipelineSplit("pp", "interleaved_1f1b", 4, virtual_stages=2)])
    table = pm.schedule_table()
    assert table.columns[1].header == "rank 0" and len(table.columns) == 3
    cells = [str(c) for column in table.columns[1:] for c in column._cells]
    assert sum("F0s0" in c for c in cells) == 1 and sum("B3s3" in c for c in cells) == 1
