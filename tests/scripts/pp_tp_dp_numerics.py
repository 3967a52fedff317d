"""PP2 x TP2 (+SP) x FSDP2 on 8 ranks against the unsharded model; rank 0 writes the errors as JSON.

Run by tests/unit/test_eight_ranks.py under `torchrun --nproc-per-node 8`.
"""

import json
import sys
from datetime import timedelta

import torch.distributed as dist

import dtmega
from dtmega.passes import DataParallel, PipelineSplit, SequenceParallel, TensorParallel
from tests.helpers import build_dtmega_llama, compare_training, debug_llama

dist.init_process_group("gloo", timeout=timedelta(seconds=120))
results = {}
for schedule, virtual in (("1f1b", 1), ("interleaved_1f1b", 2)):
    reference, meta_copy = build_dtmega_llama(debug_llama(n_layers=4), seed=3)
    plan = [TensorParallel(), SequenceParallel(), PipelineSplit(schedule=schedule, virtual_stages=virtual, microbatches=4),
            DataParallel("fsdp")]
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(pp=2, dp_shard=2, tp=2, device_type="cpu"), dtmega.Plan(plan))
    pm.init_weights(seed=3)
    result = compare_training(reference, pm, steps=3, batch_size=8)
    results[schedule] = {"loss": result.loss, "grad": result.grad, "param": result.param}
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)
dist.destroy_process_group()
