"""The batch is split over the axes a pass splits it over, and nothing else: a researcher's pass
that shards the embedding over dp_shard (without DataParallel) trains with the unsharded
model's loss and gradients (it trained with 5.568312 for 5.572870 when the batch was split over
every data-named axis regardless). fp32 tolerances of tests/helpers.py."""

from __future__ import annotations

import dtmega
from tests.helpers import assert_close_to_reference, build_dtmega_llama, compare_training, debug_llama, first_copy_mesh
from tests.user_passes import EmbeddingOverAxis


def test_a_model_parallel_pass_on_a_data_named_axis_sees_the_whole_batch():
    reference, meta_copy = build_dtmega_llama(debug_llama(), seed=31)
    pm = dtmega.parallelize(meta_copy(), first_copy_mesh(dp_shard=2), dtmega.Plan([EmbeddingOverAxis()]))
    pm.init_weights(seed=31)
    assert pm.layout.batch_axes == () and pm.dp_size == 1
    assert pm.layout["tok_embeddings"].params["weight"].placements == {"dp_shard": "S(0)"}
    assert_close_to_reference(compare_training(reference, pm, steps=3, batch_size=4, seq_len=16))
