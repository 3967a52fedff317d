"""GPT samples, splits, blends and the data-parallel loader."""

from __future__ import annotations

import numpy as np
import pytest

from dtmega.data.blend import Blend, DataConfig, blending_indices, build_datasets, parse_blend, parse_data_path
from dtmega.data.gpt_dataset import DatasetTooSmallError, GPTDataset, GPTDatasetSpec, split_bounds
from dtmega.data.indexed import IndexedDataset, IndexedDatasetWriter
from dtmega.data.loader import BatchLoader, sample_to_fields

EOD = 99


def corpus(path, documents=50, seed=0):
    """Documents of distinct increasing ids so every token says where it came from."""
    rng = np.random.RandomState(seed)
    writer = IndexedDatasetWriter(path, np.int32)
    token = 1000
    for _ in range(documents):
        length = rng.randint(3, 30)
        writer.add_document([np.arange(token, token + length)])
        token += length
    writer.finalize()
    return IndexedDataset(path)


def test_split_bounds_like_megatron():
    """Megatron's split matrix: cumulative shares, each end rounded; a part of weight 0 is None."""
    assert split_bounds([969, 30, 1], 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_bounds([98, 2, 0], 50) == [(0, 49), (49, 50), None]
    assert split_bounds([99, 1, 0], 30) == [(0, 30), (30, 30), None]  # a part with no sequence: empty, not None
    with pytest.raises(ValueError, match="three non-negative weights"):
        split_bounds([1, 1], 10)


def test_samples_are_consecutive_windows_of_the_shuffled_stream(tmp_path):
    data = corpus(tmp_path / "c")
    spec = GPTDatasetSpec(str(tmp_path / "c"), "train", (0, 50), 16, 100, seed=3)
    dataset = GPTDataset(data, spec)
    order = dataset.index["order"]
    stream = np.concatenate([data[int(s)] for s in order])
    unshuffled = np.argsort(dataset.index["shuffle"])
    for j in range(len(dataset)):
        assert np.array_equal(dataset[unshuffled[j]], stream[j * 16: j * 16 + 17])
    assert sorted(order) == sorted(list(range(len(data))) * dataset.size.epochs)  # every document once per epoch


def test_deterministic_by_seed_and_cached_on_disk(tmp_path):
    data = corpus(tmp_path / "c")
    make = lambda seed: GPTDataset(data, GPTDatasetSpec(str(tmp_path / "c"), "train", (0, 50), 8, 40, seed))  # noqa: E731
    first, again, other = make(1), make(1), make(2)
    assert spec_dir_count(tmp_path) == 2
    assert all(np.array_equal(first[i], again[i]) for i in range(len(first)))
    assert not all(np.array_equal(first[i], other[i]) for i in range(len(first)))


def test_another_corpus_under_the_same_prefix_gets_its_own_sample_index(tmp_path):
    """Re-preprocessing other data into the same prefix must not reuse the old cached index
    (whose windows would cut the new documents at the old boundaries)."""
    config = DataConfig(data_path=(str(tmp_path / "c"),), split=(1.0, 0.0, 0.0), seq_length=8, seed=5)
    corpus(tmp_path / "c", documents=50, seed=0)
    first = build_datasets(config, {"train": 20})["train"]
    data = corpus(tmp_path / "c", documents=60, seed=1)
    second = build_datasets(config, {"train": 20})["train"]
    assert spec_dir_count(tmp_path) == 2
    order = second.index["order"]
    stream = np.concatenate([data[int(s)] for s in order])
    unshuffled = np.argsort(second.index["shuffle"])
    assert all(np.array_equal(second[unshuffled[j]], stream[j * 8: j * 8 + 9]) for j in range(len(second)))
    assert not np.array_equal(first.index["starts"][:10], second.index["starts"][:10])


def spec_dir_count(tmp_path):
    return len(list((tmp_path / "c.dtmega-index").iterdir()))


def test_dataset_smaller_than_one_sample(tmp_path):
    data = corpus(tmp_path / "c", documents=2)
    with pytest.raises(DatasetTooSmallError, match="fewer than one sample of --seq-length 4096"):
        GPTDataset(data, GPTDatasetSpec(str(tmp_path / "c"), "train", (0, 2), 4096, 10, 0))


def test_parse_data_path_forms_and_errors():
    assert parse_data_path(["a"]) == [(1.0, "a")]
    assert parse_data_path(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    assert parse_data_path(["1", "a", "3", "b"]) == [(0.25, "a"), (0.75, "b")]
    assert parse_blend(["a", "b"]) == Blend(("a", "b"), None)  # no weights: Megatron blends by the datasets' sizes
    assert parse_blend(["1", "a", "3", "b"]) == Blend(("a", "b"), (1.0, 3.0))
    with pytest.raises(ValueError, match="mixes weights and paths unevenly"):
        parse_data_path(["0.3", "a", "b"])
    with pytest.raises(ValueError, match="mixes weights and paths unevenly"):
        parse_data_path(["0.3", "a", "0.7"])
    with pytest.raises(ValueError, match="must be positive"):
        parse_data_path(["-1", "a", "2", "b"])
    with pytest.raises(ValueError, match="is empty"):
        parse_data_path([])


def test_blends_follow_the_weights(tmp_path):
    dataset_index, sample_index = blending_indices(np.array([0.3, 0.7]), 1000)
    assert abs((dataset_index == 0).mean() - 0.3) < 0.002
    assert list(sample_index[dataset_index == 1][:5]) == [0, 1, 2, 3, 4]
    corpus(tmp_path / "a", seed=1)
    corpus(tmp_path / "b", seed=2)
    config = DataConfig((str(0.25), str(tmp_path / "a"), str(0.75), str(tmp_path / "b")), (90, 10, 0), 8, 5)
    datasets = build_datasets(config, {"train": 200, "valid": 20, "test": 20})
    assert len(datasets["train"]) == 200 and len(datasets["valid"]) == 20 and datasets["test"] is None


def test_loader_deals_micro_batches_to_ranks_as_megatrons_sampler(tmp_path):
    """Megatron's pretraining sampler: each run of micro_batch x dp positions gives rank r its
    micro_batch positions at r x micro_batch; a rank's micro-batches are every dp-th such slice."""
    data = corpus(tmp_path / "c")
    dataset = GPTDataset(data, GPTDatasetSpec(str(tmp_path / "c"), "train", (0, 50), 8, 64, 0))
    loaders = [BatchLoader(dataset, 8, rank, 2, eod=EOD, micro_batch=2) for rank in range(2)]
    assert loaders[0].positions() == [0, 1, 4, 5] and loaders[1].positions() == [2, 3, 6, 7]
    tokens = next(loaders[1])["tokens"]
    assert np.array_equal(tokens, np.stack([dataset[i][:-1] for i in (2, 3, 6, 7)]))
    assert loaders[1].positions() == [10, 11, 14, 15]


def test_loader_slices_global_batches_by_rank_and_resumes(tmp_path):
    data = corpus(tmp_path / "c")
    dataset = GPTDataset(data, GPTDatasetSpec(str(tmp_path / "c"), "train", (0, 50), 8, 64, 0))
    ranks = [BatchLoader(dataset, 8, rank, 2, eod=EOD) for rank in range(2)]
    first = [next(loader)["tokens"] for loader in ranks]
    assert np.array_equal(np.concatenate(first), np.stack([dataset[i][:-1] for i in range(8)]))
    resumed = BatchLoader(dataset, 8, 1, 2, eod=EOD, consumed_samples=8)
    assert np.array_equal(next(resumed)["tokens"], next(ranks[1])["tokens"])
    with pytest.raises(ValueError, match="not divisible by 3"):
        BatchLoader(dataset, 8, 0, 3, eod=EOD)


def test_eod_loss_mask_and_position_reset():
    sample = np.array([[5, 6, EOD, 7, 8, EOD, 9]])
    fields = sample_to_fields(sample, EOD, eod_mask_loss=True, reset_position_ids=True)
    assert fields["labels"].tolist() == [[6, EOD, 7, 8, EOD, 9]]
    assert fields["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0]]
    assert fields["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2]]


def test_a_sample_index_past_memory_is_refused_before_it_is_built(tmp_path):
    """Matrix 3, A4: `--train-iters 10^12` grew the index until memory ran out (7.9 GB, then a raw
    MemoryError). Now the size is computed from the counts and refused with it, nothing built."""
    from dtmega.data.gpt_dataset import SampleIndexTooLargeError

    corpus(tmp_path / "c")
    data = IndexedDataset(tmp_path / "c")
    with pytest.raises(SampleIndexTooLargeError, match=r"asked for 1,000,000,000,000 samples: .* epochs of its 50 "
                                                        r"documents, whose sample index takes [\d,.]+ GiB"):
        GPTDataset(data, GPTDatasetSpec(str(tmp_path / "c"), "train", (0, 50), 16, 10**12, seed=0))
    assert not list(tmp_path.rglob("*.dtmega-index*"))
    GPTDataset(data, GPTDatasetSpec(str(tmp_path / "c"), "train", (0, 50), 16, 1000, seed=0))  # a real size builds
