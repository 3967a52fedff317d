"""A torch.distributed.checkpoint StorageReader that presents a Hugging Face safetensors
checkpoint under dtmega's names and layout, so `dcp.load` fills a model sharded by any plan.

DCP's load planner works out, for every tensor a rank holds (a DTensor shard of any placement,
a pipeline stage's plain tensor), which region of the stored tensor it needs; this reader
answers each request by slicing the safetensors files (`safe_open(...).get_slice`), so a rank
reads only what it owns and no rank ever holds the whole model. Two requests need more than a
slice: RoPE-permuted q/k rows (the heads the rows touch are read and reordered,
`WeightSource.reorder`) and routed experts (dtmega's [experts, ...] tensor is one HF tensor per
expert: the rank's experts are read and stacked). An fp8 tensor with block scales (`scales`) is
dequantized region by region: the region's weights times the scales of the blocks it touches.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.llama.hf_names import WeightSource


class HFSafetensorsReader(StorageReader):
    """Reads `sources` (dtmega name -> WeightSource) from safetensors files (`files`: HF tensor
    name -> file path) as tensors of `shapes` (dtmega name -> global shape) and `dtypes`."""

    def __init__(self, files: dict[str, Path], sources: dict[str, WeightSource],
                 shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                 scales: dict[str, str] | None = None, block: tuple[int, int] | None = None):
        super().__init__()
        self.files, self.sources, self.shapes, self.dtypes = files, sources, shapes, dtypes
        self.scales, self.block = scales or {}, block

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Nothing to reset: the reader is built for one load."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Any directory may hold safetensors; the reader is built from its parsed index."""
        return Path(checkpoint_id).is_dir()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """Each dtmega tensor as one whole stored chunk at offset 0."""
        state, storage = {}, {}
        for name, shape in self.shapes.items():
            size = torch.Size(shape)
            state[name] = TensorStorageMetadata(TensorProperties(dtype=self.dtypes[name]), size,
                                                [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)])
            storage[MetadataIndex(name, [0] * len(shape))] = self.sources[name]
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        """Every rank built the same reader from the same index; nothing to share."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged: DCP's planner already asks for exactly this rank's regions."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads each requested region from the files (each file opened once) into the model."""
        handles: dict[Path, object] = {}
        try:
            for item in plan.items:
                source = self.sources[item.storage_index.fqn]
                region = self._region(handles, source, list(item.storage_offsets), list(item.lengths))
                if region.is_floating_point() and not bool(torch.isfinite(region).all()):
                    # matrix 3, F16: NaN weights were served, converted and trained with exit 0
                    bad = int((~torch.isfinite(region)).sum())
                    raise HFFormatError(f"{self.files[source.names[0]]}: {source.names[0]} holds {bad} non-finite "
                                        "values (NaN or infinity): the checkpoint is damaged and would compute NaN. "
                                        "Fix: the model's intact weights")
                target = planner.resolve_tensor(item).detach()
                target.copy_(region)
                planner.commit_tensor(item, target)
        finally:
            handles.clear()
        done: Future = Future()
        done.set_result(None)
        return done

    def _slice(self, handles: dict, name: str, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        path = self.files[name]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        window = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
        region = handles[path].get_slice(name)[window]
        if name in self.scales:
            region = self._dequantized(handles, region, self.scales[name], offsets, lengths)
        return region

    def _dequantized(self, handles: dict, region: torch.Tensor, scale_name: str, offsets: list[int],
                     lengths: list[int]) -> torch.Tensor:
        """An fp8 region in float32: each element times its (rows x cols) block's scale."""
        rows, cols = self.block
        first = [offsets[0] // rows, offsets[1] // cols]
        last = [-(-(offsets[0] + lengths[0]) // rows), -(-(offsets[1] + lengths[1]) // cols)]
        scale = self._slice(handles, scale_name, first, [last[0] - first[0], last[1] - first[1]]).float()
        scale = scale.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
        top, left = offsets[0] - first[0] * rows, offsets[1] - first[1] * cols
        return region.float() * scale[top:top + lengths[0], left:left + lengths[1]]

    def _region(self, handles: dict, source: WeightSource, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        if source.transpose and len(offsets) == 2:  # a Conv1D [in, out]: dtmega's rows are its columns
            block = self._slice(handles, source.names[0], [offsets[1], source.offset + offsets[0]],
                                [lengths[1], lengths[0]])
            return block.t()
        if source.offset:  # a part of a fused tensor (GPT-2's q/k/v bias)
            return self._slice(handles, source.names[0], [source.offset + offsets[0], *offsets[1:]], lengths)
        if source.stacked:  # experts [first, first + count) of dtmega's stacked tensor
            first, count = offsets[0], lengths[0]
            return torch.stack([self._slice(handles, source.names[e], offsets[1:], lengths[1:])
                                for e in range(first, first + count)])
        if source.heads:  # the whole heads the rows touch, reordered, then the rows
            head_dim, row, rows = source.head_dim, offsets[0], lengths[0]
            first, last = row // head_dim, -(-(row + rows) // head_dim)
            block = self._slice(handles, source.names[0], [first * head_dim, *offsets[1:]],
                                [(last - first) * head_dim, *lengths[1:]])
            start = row - first * head_dim
            return source.reorder(block, last - first)[start:start + rows]
        return self._slice(handles, source.names[0], offsets, lengths)
