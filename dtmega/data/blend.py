"""Dataset blends with Megatron's syntax (`--data-path a`, `--data-path a b`, `--data-path 0.3 a
0.7 b`) and train/valid/test splits, built as Megatron-Core's BlendedMegatronDatasetBuilder builds
them (megatron/core/datasets/blended_megatron_dataset_builder.py, 0.16):

- one prefix without a weight: its split is the dataset itself;
- weights (one prefix with a weight too): each component is asked for ceil(ceil(N x w) x 1.005)
  samples (Megatron's mid-level surplus) and the blend holds sum(ceil(N x w)) samples, dealt by
  Megatron's greedy rule (the component furthest behind its share, max(i, 1) samples in);
- several prefixes without weights: each component is one epoch of its split, blended in
  proportion to those sizes, the blend capped at their total (Megatron's "exhaustive" blend: a
  run longer than that is refused here, where Megatron's loader would run dry).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from dtmega.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetSpec,
    cached_index,
    split_bounds,
    split_size,
)
from dtmega.data.indexed import IndexedDataset
from dtmega.kernels.errors import DtmegaError

SPLITS = ("train", "valid", "test")
MID_LEVEL_SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Blend:
    """The prefixes of a --data-path and their weights as given (None: given without weights)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None


def parse_blend(items: list[str]) -> Blend:
    """`a`, `a b` (no weights) or `0.3 a 0.7 b` (weights: positive and finite; normalized where
    the blend is built, as Megatron normalizes them)."""
    if not items:
        raise DtmegaError("--data-path is empty; give a dataset prefix such as data/corpus_text_document")
    items = [str(item) for item in items]  # a TOML list's numbers are their text, as on the command line (A6)
    numeric = [_is_number(item) for item in items]
    if not any(numeric):
        return Blend(tuple(items), None)
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise DtmegaError(
            f"--data-path {' '.join(items)!r} mixes weights and paths unevenly; use either paths only "
            "or weight/path pairs: --data-path 0.3 data/a_text_document 0.7 data/b_text_document"
        )
    weights = [float(items[i]) for i in range(0, len(items), 2)]
    bad = [w for w in weights if not (w > 0 and np.isfinite(w))]
    if bad:
        raise DtmegaError(f"--data-path weights must be positive numbers, got {bad}")
    return Blend(tuple(items[1::2]), tuple(weights))


def parse_data_path(items: list[str]) -> list[tuple[float, str]]:
    """(weight, prefix) pairs (equal weights when none are given): the prefixes a run reads."""
    blend = parse_blend(items)
    weights = normalize(list(blend.weights)) if blend.weights else [1.0 / len(blend.prefixes)] * len(blend.prefixes)
    return list(zip(weights, blend.prefixes))


def blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of `size` samples, which dataset and which of its samples: the dataset furthest
    behind its share, weight x max(i, 1) - taken so far, the first on a tie (Megatron's
    build_blending_indices, in the same double-precision arithmetic)."""
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    shares = [float(w) for w in weights]
    counts = [0] * len(shares)
    for i in range(size):
        at = float(max(i, 1))
        chosen, best = 0, shares[0] * at - counts[0]
        for k in range(1, len(shares)):
            error = shares[k] * at - counts[k]
            if error > best:
                chosen, best = k, error
        dataset_index[i], sample_index[i] = chosen, counts[chosen]
        counts[chosen] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets in fixed proportions, deterministically."""

    def __init__(self, datasets: list[GPTDataset], weights: list[float], size: int, cache_key: str):
        self.datasets = datasets
        path = datasets[0].spec.cache_path().with_name(f"blend-{cache_key}")

        def build():
            dataset_index, sample_index = blending_indices(np.asarray(weights, dtype=np.float64), size)
            return {"dataset_index": dataset_index, "sample_index": sample_index}

        self.index = cached_index(path, build)

    def __len__(self) -> int:
        return len(self.index["dataset_index"])

    def __getitem__(self, i: int) -> np.ndarray:
        dataset = self.datasets[int(self.index["dataset_index"][i])]
        return dataset[int(self.index["sample_index"][i])]


@dataclass(frozen=True)
class DataConfig:
    """What the trainer asks of the data: where, how long, how many, which seed."""

    data_path: tuple[str, ...]
    split: tuple[float, float, float] = (969.0, 30.0, 1.0)
    seq_length: int = 1024
    seed: int = 1234
    cache_dir: str | None = None  # --data-cache-path (default: each index beside its data)
    # --train/--valid/--test-data-path: each split's own blend, every document of it used (the
    # split proportions and data_path are then not read); an empty one builds no such split
    per_split: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None
    mmap: bool = True  # False: --no-mmap-bin-files, tokens read with file reads


@dataclass(frozen=True)
class SplitPlan:
    """One split as the run will read it, decided from the indices alone (nothing built): its
    components (the dataset specs), the blend's weights and size (None for a single dataset), how
    many samples are wanted and how many sequences it holds. `build()` makes the dataset; the dry
    run stops before it."""

    name: str
    components: tuple[GPTDatasetSpec, ...]
    weights: tuple[float, ...] | None
    size: int | None
    wanted: int
    documents: int
    mmap: bool = True

    def build(self) -> GPTDataset | BlendedDataset:
        """The split's dataset (sample indices built once, cached beside the data)."""
        parts = [GPTDataset(IndexedDataset(spec.prefix, self.mmap), spec) for spec in self.components]
        if self.weights is None:
            return parts[0]
        key = "-".join([self.name, str(self.size), *(repr(w) for w in self.weights),
                        *(spec.cache_path().name for spec in self.components)])
        key = f"{self.name}-{_digest(key)}"
        return BlendedDataset(parts, list(self.weights), int(self.size or 0), key)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def normalize(weights: list[float]) -> list[float]:
    """Weights over their sum in float64, as Megatron normalizes them (scaled by the largest first
    when the sum would overflow)."""
    w = np.array(weights, dtype=np.float64)
    total = np.sum(w)
    if not np.isfinite(total):
        w = w / np.max(w)
        total = np.sum(w)
    return (w / total).tolist()


def plan_datasets(config: DataConfig, num_samples: dict[str, int]) -> dict[str, SplitPlan | None]:
    """What `build_datasets` will build, checked from the `.idx` files alone: every split's
    sequences, and every component long enough for one sample (DatasetTooSmallError otherwise).
    None where a split has no sequences or no samples are asked for. The dry run and the launch
    both call it, so they refuse the same data with the same words."""
    if config.per_split is not None:
        return {name: _plan_split(name, parse_blend(list(paths)), config, num_samples.get(name, 0), whole=True)
                if paths else None for name, paths in zip(SPLITS, config.per_split)}
    blend = parse_blend(list(config.data_path))
    return {name: _plan_split(name, blend, config, num_samples.get(name, 0)) for name in SPLITS}


def build_datasets(config: DataConfig, num_samples: dict[str, int]) -> dict[str, GPTDataset | BlendedDataset | None]:
    """train/valid/test datasets holding at least `num_samples[split]` samples each (None where a
    split has no sequences or no samples are asked for): the --split parts of one blend, or with
    `config.per_split` each split's own blend, whole."""
    return {name: plan.build() if plan is not None else None
            for name, plan in plan_datasets(config, num_samples).items()}


def _plan_split(name: str, blend: Blend, config: DataConfig, wanted: int, whole: bool = False) -> SplitPlan | None:
    """One split of a blend, sized as Megatron's builder sizes it (see the module docstring)."""
    if wanted <= 0:
        return None
    ranges, identities = [], []
    for prefix in blend.prefixes:
        dataset = IndexedDataset(prefix)
        bounds = (0, len(dataset)) if whole else split_bounds(list(config.split), len(dataset))[SPLITS.index(name)]
        ranges.append(bounds if bounds is not None and bounds[1] > bounds[0] else None)
        identities.append(dataset.identity)
    if all(r is None for r in ranges):
        return None
    empty = [prefix for prefix, r in zip(blend.prefixes, ranges) if r is None]
    if empty:
        raise DtmegaError(f"the {name} part of --split {','.join(f'{w:g}' for w in config.split)} holds no document of "
                          f"{', '.join(empty)} but some of the other datasets of the blend: the blend cannot keep its "
                          "weights there. Fix: more data in those datasets, or a --split that gives the part more")
    weights: tuple[float, ...] | None = None
    size: int | None = None
    if blend.weights is None and len(blend.prefixes) == 1:
        requests: list[int | None] = [wanted]
    elif blend.weights is not None:
        shares = normalize(list(blend.weights))
        targets = [int(math.ceil(wanted * w)) for w in shares]
        requests = [int(math.ceil(math.ceil(wanted * w) * (1 + MID_LEVEL_SURPLUS))) for w in shares]
        weights, size = tuple(normalize(shares)), sum(targets)  # the blend normalizes again, as Megatron's does
    else:
        requests = [None] * len(blend.prefixes)  # one epoch of each, blended by those sizes
    specs, sizes = [], []
    for prefix, bounds, identity, request in zip(blend.prefixes, ranges, identities, requests):
        spec = GPTDatasetSpec(prefix, name, bounds, config.seq_length, request, config.seed, identity, config.cache_dir)
        sizes.append(split_size(IndexedDataset(prefix), spec).samples)  # shorter than one sample: refused here
        specs.append(spec)
    if blend.weights is None and len(blend.prefixes) > 1:
        weights, size = tuple(normalize(sizes)), min(wanted, sum(sizes))
        if size < wanted:
            raise DtmegaError(f"--data-path {' '.join(blend.prefixes)} gives no weights, so its {name} part blends one "
                              f"epoch of each dataset ({sum(sizes)} samples of --seq-length {config.seq_length}, as "
                              f"Megatron builds it), and the run reads {wanted}. Fix: give weights (--data-path "
                              f"{' '.join(f'1 {p}' for p in blend.prefixes)}), which repeat epochs as needed")
    return SplitPlan(name, tuple(specs), weights, size, wanted, sum(r[1] - r[0] for r in ranges), config.mmap)
