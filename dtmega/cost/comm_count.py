"""Collectives and point-to-point sends a step really issues, with their sizes and process
groups, for checking the cost model's closed forms on real ranks.

It counts at the level torch's CommDebugMode counts (a dispatch mode sees every c10d and
functional collective op) and adds what that leaves out: each op's tensor bytes, its process
group, and the sends of pipeline stages and the context-parallel ring (`c10d.send`).
CommDebugMode itself cannot be the base: its module tracker raises inside torch's pipeline
schedules (IndexError in `_fw_set_module_hook`, torch 2.13), so the tests check this count
against CommDebugMode's on every plan it can run.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# the dispatcher's op names -> the cost model's collective kinds
KINDS = {
    "all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all", "send": "send",
}
OUTPUT_FIRST = {"_allgather_base_", "allgather_", "_reduce_scatter_base_", "reduce_scatter_"}  # c10d: (output, input)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_name(args: tuple, kwargs: dict) -> str | None:
    """The process group an op runs on: functional collectives name it, c10d ops pass it."""
    for arg in [*args, *kwargs.values()]:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return dist.ProcessGroup.unbox(arg).group_name
    return args[-1] if args and isinstance(args[-1], str) else None


class CollectiveBytes(TorchDispatchMode):
    """Sums, per collective kind, the calls and the bytes of the tensor handed to it
    (an all-gather's output, a reduce-scatter's input, an all-reduce's or all-to-all's buffer, a
    send's payload), in total (`bytes`, `calls`) and per process group name (`by_group[name]`,
    {kind: [calls, bytes]}): `mesh.get_group(axis).group_name` names an axis's group."""

    def __enter__(self):
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.by_group: dict[str | None, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):  # no collective, no overload packet
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first, and count those
        name = func._overloadpacket.__name__
        kind = KINDS.get(name)
        out = func(*args, **(kwargs or {}))
        if kind is not None:
            tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
            if kind == "all_gather" and name not in OUTPUT_FIRST:  # functional: the output is returned
                size = sum(_nbytes(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            elif name in OUTPUT_FIRST:
                size = _nbytes(tensors[0 if kind == "all_gather" else 1])
            elif kind == "send":  # c10d.send(tensors, group, peer, tag): every tensor goes out
                size = sum(_nbytes(t) for t in tensors)
            else:
                size = _nbytes(tensors[0]) if tensors else 0
            self.bytes[kind] += size
            self.calls[kind] += 1
            entry = self.by_group[_group_name(args, kwargs or {})][kind]
            entry[0] += 1
            entry[1] += size
        return out
