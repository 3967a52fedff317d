"""Dataset blends with Megatron's syntax (`--data-path 0.3 a 0.7 b`) and train/valid/test splits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtmega.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetSpec,
    cached_index,
    split_documents,
    split_sequences,
)
from dtmega.data.indexed import IndexedDataset
from dtmega.kernels.errors import DtmegaError

SPLITS = ("train", "valid", "test")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(items: list[str]) -> list[tuple[float, str]]:
    """(weight, prefix) pairs from `a`, `a b` (equal weights) or `0.3 a 0.7 b`."""
    if not items:
        raise DtmegaError("--data-path is empty; give a dataset prefix such as data/corpus_text_document")
    numeric = [_is_number(item) for item in items]
    if not any(numeric):
        return [(1.0, prefix) for prefix in items]
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise DtmegaError(
            f"--data-path {' '.join(items)!r} mixes weights and paths unevenly; use either paths only "
            "(equal weights) or weight/path pairs: --data-path 0.3 data/a_text_document 0.7 data/b_text_document"
        )
    pairs = [(float(items[i]), items[i + 1]) for i in range(0, len(items), 2)]
    bad = [w for w, _ in pairs if not (w > 0 and np.isfinite(w))]
    if bad:
        raise DtmegaError(f"--data-path weights must be positive numbers, got {bad}")
    largest = max(w for w, _ in pairs)  # scaled first: 1e308 + 1e308 overflows to inf
    total = sum(w / largest for w, _ in pairs)
    return [(w / largest / total, prefix) for w, prefix in pairs]


def blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of `size` samples, which dataset and which of its samples: greedily pick the
    dataset furthest behind its target share (Megatron's blending rule)."""
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    counts = np.zeros(len(weights), dtype=np.int64)
    for i in range(size):
        chosen = int(np.argmax(weights * (i + 1) - counts))
        dataset_index[i], sample_index[i] = chosen, counts[chosen]
        counts[chosen] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Samples drawn from several datasets in fixed proportions, deterministically."""

    def __init__(self, datasets: list[GPTDataset], weights: list[float], size: int, cache_key: str):
        self.datasets = datasets
        path = datasets[0].spec.cache_path().with_name(f"blend-{cache_key}")

        def build():
            dataset_index, sample_index = blending_indices(np.asarray(weights), size)
            return {"dataset_index": dataset_index, "sample_index": sample_index}

        self.index = cached_index(path, build)

    def __len__(self) -> int:
        return len(self.index["dataset_index"])

    def __getitem__(self, i: int) -> np.ndarray:
        dataset = self.datasets[int(self.index["dataset_index"][i])]
        return dataset[int(self.index["sample_index"][i]) % len(dataset)]


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
    components (weight, the dataset's spec), how many samples are wanted, and how many documents
    it holds. `build()` makes the dataset; the dry run stops before it."""

    name: str
    components: tuple[tuple[float, GPTDatasetSpec], ...]
    wanted: int
    documents: int
    mmap: bool = True

    def build(self) -> GPTDataset | BlendedDataset:
        """The split's dataset (sample indices built once, cached beside the data)."""
        parts = [(weight, GPTDataset(IndexedDataset(spec.prefix, self.mmap), spec)) for weight, spec in self.components]
        if len(parts) == 1:
            return parts[0][1]
        weights = [w for w, _ in parts]
        total = sum(weights)
        key = f"{self.name}-{len(parts)}-{self.wanted}-{parts[0][1].spec.seed}-" + "-".join(
            f"{w / total:.6f}" for w in weights)
        return BlendedDataset([d for _, d in parts], [w / total for w in weights], self.wanted, key)


def plan_datasets(config: DataConfig, num_samples: dict[str, int]) -> dict[str, SplitPlan | None]:
    """What `build_datasets` will build, checked from the `.idx` files alone: every split's
    documents, and every component long enough for one sample (DatasetTooSmallError otherwise).
    None where a split has no documents or no samples are asked for. The dry run and the launch
    both call it, so they refuse the same data with the same words."""
    if config.per_split is not None:
        return {name: _plan_split(name, parse_data_path(list(paths)), config, num_samples.get(name, 0), whole=True)
                if paths else None for name, paths in zip(SPLITS, config.per_split)}
    blend = parse_data_path(list(config.data_path))
    return {name: _plan_split(name, blend, config, num_samples.get(name, 0)) for name in SPLITS}


def build_datasets(config: DataConfig, num_samples: dict[str, int]) -> dict[str, GPTDataset | BlendedDataset | None]:
    """train/valid/test datasets with at least `num_samples[split]` samples each (None where a
    split has no documents or no samples are asked for): the --split parts of one blend, or
    with `config.per_split` each split's own blend, whole."""
    return {name: plan.build() if plan is not None else None
            for name, plan in plan_datasets(config, num_samples).items()}


def _plan_split(name: str, blend: list[tuple[float, str]], config: DataConfig, wanted: int,
                whole: bool = False) -> SplitPlan | None:
    """One split: each component's documents in it (`whole`: all of them), blended by weight."""
    split_index = SPLITS.index(name)
    components, documents = [], 0
    for weight, prefix in blend:
        dataset = IndexedDataset(prefix)
        lo, hi = (0, dataset.num_documents) if whole else \
            split_documents(list(config.split), dataset.num_documents)[split_index]
        if hi <= lo or wanted <= 0:
            continue
        # a 0.5% margin as Megatron, so that rounding never starves a blend component
        share = wanted if len(blend) == 1 else int(np.ceil(weight * wanted * 1.005))
        spec = GPTDatasetSpec(prefix, name, (lo, hi), config.seq_length, share, config.seed, dataset.identity,
                              config.cache_dir)
        split_sequences(dataset, spec)  # a component shorter than one sample is refused here, before anything is built
        components.append((weight, spec))
        documents += hi - lo
    if not components:
        return None
    return SplitPlan(name, tuple(components), wanted, documents, config.mmap)
