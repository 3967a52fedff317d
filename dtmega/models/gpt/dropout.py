"""Dropout whose masks do not depend on the plan: a mask element is a pure function of (the
run's dropout seed, the dropout site, the token's global sample and position, the element's
global feature or head and key position), never of a random-number generator's state.

torch's `nn.Dropout` draws from the device generator, so the masks depend on how many draws came
before (which differs by pipeline stage, by rank and by recompute) and on the local shape (which
differs by tensor, sequence and data parallelism). Here every token carries a 64-bit key made from
its sample's index in the global batch order and its position (`token_keys`), threaded through the
blocks like RoPE's angles; a site mixes its own id, and an element its feature index (or, for
attention probabilities, its head and key position). So:

- one rank and any TP/PP/DP/FSDP layout draw the same mask for the same token (a data-parallel
  rank's samples get their global indices, `sample_ids`);
- recompute replays the same masks (the keys are an input of the recomputed block);
- evaluation and generation drop nothing (`module.training` is False there).

The hash is splitmix64's finalizer on int64 tensors (multiplication wraps modulo 2**64); 53 bits of
it compared with p * 2**53 decide each element. Cost: a few int64 ops per element (a Triton kernel
fusing it with the bias and residual add is the GPU path's next step).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

_MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as torch's int64."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_FEATURE = _signed(0xD6E8FEB86659FD93)
_KEYPOS = _signed(0xA0761D6478BD642F)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijective scramble of 64-bit integers."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def site_id(name: str) -> int:
    """A 64-bit id for a dropout site (its module path inside the model)."""
    return _signed(zlib.crc32(name.encode()) * 0x100000001B3 + len(name))


def token_keys(seed: int, sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, S] int64 keys for tokens of samples `sample_ids` [B] at `positions` [B or 1, S]."""
    sample = mix(sample_ids.to(torch.int64) * _GOLDEN + _signed(seed * 0x632BE59BD9B4E019 + 1))
    return mix(sample[:, None] + positions.to(torch.int64) * _GOLDEN)


def _keep(hashed: torch.Tensor, p: float) -> torch.Tensor:
    return _shr(hashed, 11) >= int(p * (1 << 53))


def feature_mask(keys: torch.Tensor, site: int, width: int, p: float, offset: int = 0) -> torch.Tensor:
    """Keep-mask [B, S, width] for features offset .. offset + width of tokens `keys` [B, S]."""
    features = torch.arange(offset, offset + width, device=keys.device, dtype=torch.int64) * _FEATURE
    return _keep(mix(mix(keys + site)[..., None] + features), p)


def attention_mask(keys: torch.Tensor, site: int, heads: int, key_len: int, p: float,
                   head_offset: int = 0) -> torch.Tensor:
    """Keep-mask [B, heads, S_q, S_k] for the attention probabilities of query tokens `keys`
    [B, S_q]: heads head_offset .. + heads, key positions 0 .. key_len."""
    head = torch.arange(head_offset, head_offset + heads, device=keys.device, dtype=torch.int64) * _FEATURE
    key_pos = torch.arange(key_len, device=keys.device, dtype=torch.int64) * _KEYPOS
    base = mix(keys + site)  # [B, Sq]
    return _keep(mix(base[:, None, :, None] + head[None, :, None, None] + key_pos), p)


class KeyedDropout(nn.Module):
    """Dropout of [B, S, D] activations with plan-independent masks (module docstring). `site`
    is set by the model from the module's path; `p` is the drop probability."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.site = 0

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """`keys` by keyword (a sequence-parallel style's input hook passes only `x` positionally)."""
        if not self.training or self.p == 0.0 or keys is None:
            return x
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):  # a sequence-parallel slot: this rank's positions of the whole sequence
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = x.to_local()
            _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
            mine = keys[offset[0]:offset[0] + local.shape[0], offset[1]:offset[1] + local.shape[1]]
            keep = feature_mask(mine, self.site, local.shape[-1], self.p, offset[2])
            return DTensor.from_local(local * keep.to(local.dtype) / (1.0 - self.p), x.device_mesh, x.placements,
                                      run_check=False)
        if keys.shape != x.shape[:2]:
            raise RuntimeError(f"dropout keys {tuple(keys.shape)} do not cover activations {tuple(x.shape)}: a "
                               "layout that splits the sequence must split the keys with it")
        keep = feature_mask(keys, self.site, x.shape[-1], self.p)
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
