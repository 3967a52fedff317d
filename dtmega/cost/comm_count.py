"""Collectives a step really issues, with their sizes: torch's CommDebugMode counts them; this
adds each one's tensor bytes, for checking the cost model's closed forms on real ranks."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_flatten

# CommDebugMode's op names -> the cost model's collective kinds
KINDS = {
    "all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
}
OUTPUT_FIRST = {"_allgather_base_", "allgather_", "_reduce_scatter_base_", "reduce_scatter_"}  # c10d: (output, input)


class CollectiveBytes(CommDebugMode):
    """CommDebugMode that also sums, per collective kind, the bytes of the tensor handed to it
    (an all-gather's output, a reduce-scatter's input, an all-reduce's or all-to-all's buffer)."""

    def __enter__(self):
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        kind = KINDS.get(name)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if kind is not None:
            tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
            if kind == "all_gather" and name not in OUTPUT_FIRST:  # functional: the output is returned
                size = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            elif name in OUTPUT_FIRST:
                size = tensors[0 if kind == "all_gather" else 1].numel() * tensors[0 if kind == "all_gather" else 1].element_size()
            else:
                size = tensors[0].numel() * tensors[0].element_size() if tensors else 0
            self.bytes[kind] += size
            self.calls[kind] += 1
        return out
