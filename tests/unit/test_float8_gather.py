"""FP8 all-gather's tensor subclasses on their own (the FSDP2 runs: tests/distributed/test_float8.py):
the sharded weight survives what FSDP2 does to a shard, the all-gather sends the FP8 cast of the
shard padded to FSDP2's equal shards, and the gathered weight stands for its dequantized values."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dtmega.kernels.float8 import E4M3, Float8Recipe, quantize, scale_from_amax
from dtmega.kernels.float8_gather import (
    Float8GatheredWeight,
    Float8GatherScale,
    Float8ShardedWeight,
    gather_weight_in_fp8,
    plain,
)


def _source(state=None, linear=None) -> Float8GatherScale:
    """One rank's view (no group): tensorwise without a state, delayed with one."""
    recipe = Float8Recipe("delayed" if state is not None else "tensorwise", "hybrid", amax_history_len=4)
    return Float8GatherScale(recipe, state, None, linear or torch.nn.Linear(1, 1))


def test_the_sharded_weight_survives_fsdp2s_shard_ops_and_updates_in_place():
    inner = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    weight = Float8ShardedWeight(inner.clone(), _source())
    chunk = torch.chunk(weight, 2, dim=0)[1]
    padded = chunk.new_zeros(5, 16)
    padded.narrow(0, 0, 4).copy_(chunk)
    for t in (chunk, padded, padded.view(-1), padded[:4], weight.detach(), torch.empty_like(weight)):
        assert isinstance(t, Float8ShardedWeight), type(t)
    assert torch.equal(plain(padded)[:4], inner[4:]) and not plain(padded)[4].any()
    weight.add_(1.0)  # what an optimizer does: reaches the wrapped tensor
    assert torch.equal(plain(weight), inner + 1.0)
    assert type(weight * 2) is torch.Tensor  # arithmetic gives plain tensors


def test_pre_all_gather_pads_to_fsdp2s_equal_shards_and_post_all_gather_gives_the_fp8_weight():
    full = torch.randn(7, 16, generator=torch.Generator().manual_seed(1)) * 3
    # A 7-row weight over 3 ranks: shards of 3 rows (FSDP2 pads); the last rank holds rows 6-7.
    shard = Float8ShardedWeight(full[5:].clone(), _source())
    policy = SimpleNamespace(param_dtype=None)
    (data,), metadata = shard.fsdp_pre_all_gather(SimpleNamespace(shape=(3,)), torch.Size([7, 16]), (16, 1),
                                                  torch.nn.Linear(16, 7), policy)
    assert data.dtype == torch.uint8 and data.shape == (3, 16)  # ceil(7 / 3) rows, the last one padding
    scale = metadata[0]
    assert torch.equal(scale, scale_from_amax(full[5:].abs().max(), E4M3))  # no group: this shard's amax
    gathered, _ = shard.fsdp_post_all_gather((data,), metadata, torch.float32)
    assert isinstance(gathered, Float8GatheredWeight) and gathered.dtype == torch.float32
    expected = quantize(full[5:], scale, E4M3).float() / scale
    view = torch.as_strided(gathered, (2, 16), (16, 1))  # FSDP2's view of the unsharded size
    assert isinstance(view, Float8GatheredWeight)
    assert torch.equal(view.dequantized(), expected)
    assert torch.equal(view + 0, expected)  # any other op sees the dequantized values


def test_delayed_scaling_uses_its_weight_scale_and_records_the_shards_amax_while_training():
    from dtmega.kernels.float8_linear import Float8State

    linear = torch.nn.Linear(16, 4)
    state = Float8State(4)
    source = _source(state, linear)
    shard = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    assert torch.equal(source.scale(shard), scale_from_amax(shard.abs().max(), E4M3))  # no history yet
    assert state.current[1] == shard.abs().max()
    state.ready, state.scale[1] = True, 7.0
    state.current.zero_()
    linear.eval()
    assert source.scale(shard) == 7.0 and state.current[1] == 0  # evaluation records nothing


def test_checkpoints_see_plain_weights():
    linear = torch.nn.Linear(16, 16)
    gather_weight_in_fp8(linear, _source())
    assert isinstance(linear.weight, Float8ShardedWeight)
    assert type(linear.state_dict()["weight"]) is torch.Tensor
    linear.load_state_dict({"weight": torch.ones(16, 16), "bias": torch.zeros(16)})
    assert torch.equal(plain(linear.weight), torch.ones(16, 16))
