"""Megatron's sample order (issue 49, item 1): for the same data, --split, --seq-length, --seed and
sample counts, dtmega's datasets hold megatron-core's samples at every position: one prefix,
weighted blends, blends without weights, several seeds and splits, one to three epochs (with the
final partial epoch shuffled apart or not), empty documents, per-split data paths. megatron-core
(a dev dependency) builds its own GPTDataset / BlendedDataset in this process as
`pretrain_gpt.py` asks its BlendedMegatronDatasetBuilder to; each position's seq_length + 1
tokens are compared (Megatron's tokens plus the last label)."""

from __future__ import annotations

import numpy as np
import pytest

from dtmega.data.blend import DataConfig, build_datasets
from dtmega.data.indexed import IndexedDatasetWriter

SEQ = 16


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three corpora of random ids below 256, documents of 0 to 59 tokens (empty ones included)."""
    root = tmp_path_factory.mktemp("megatron_order")
    rng = np.random.RandomState(0)
    prefixes = {}
    for name, documents in (("a", 40), ("b", 25), ("c", 60)):
        writer = IndexedDatasetWriter(root / name, np.uint16)
        for _ in range(documents):
            writer.add_document([rng.randint(0, 256, size=int(rng.randint(0, 60)))])
        writer.finalize()
        prefixes[name] = str(root / name)
    return root, prefixes


def megatron_datasets(root, blend, split, seed: int, sizes: list[int], per_split=None):
    """megatron-core's train/valid/test datasets, built as pretrain_gpt.py builds them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=SEQ, blend=get_blend_from_list(blend) if per_split is None else None,
        blend_per_split=[get_blend_from_list(p) if p else None for p in per_split] if per_split else None,
        split=split if per_split is None else None, path_to_cache=str(root / f"megatron-cache-{seed}"),
        tokenizer=NullTokenizer(256), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def assert_same_samples(theirs, ours, count: int) -> None:
    assert (theirs is None) == (ours is None)
    if theirs is None:
        return
    assert len(ours) >= count
    for position in range(count):
        sample = theirs[position]
        expected = np.concatenate([sample["tokens"].numpy(), sample["labels"].numpy()[-1:]])
        assert np.array_equal(ours[position], expected), f"position {position}"


CASES = {
    # one prefix (57 samples an epoch of the train part): 107 samples use 88 % of the second epoch
    # (shuffled with the first), 95 use 67 % (shuffled apart, after the first); 170 take 3 epochs
    "one prefix": (["a"], "80,15,5", 3, [107, 20, 8]),
    "one prefix, final epoch apart": (["a"], "80,15,5", 11, [95, 20, 8]),
    "one prefix, three epochs": (["a"], "98,2,0", 5, [170, 6, 0]),
    "weighted blend": (["0.3", "a", "0.7", "b"], "90,10,0", 1234, [150, 20, 0]),
    "weighted blend of one": (["2", "a"], "90,8,2", 9, [70, 10, 4]),
    "blend without weights": (["a", "b", "c"], "90,10,0", 2, [100, 12, 0]),
    "three-way weights, many epochs": (["1", "a", "1", "b", "2", "c"], "80,15,5", 77, [400, 30, 0]),
}


@pytest.mark.parametrize("name", CASES)
def test_every_position_holds_megatrons_sample(name, corpora, one_rank_mesh):  # megatron-core blends ask the rank
    root, prefixes = corpora
    items, split, seed, sizes = CASES[name]
    blend = [prefixes.get(item, item) for item in items]
    theirs = megatron_datasets(root, blend, split, seed, sizes)
    weights = [float(x) for x in split.split(",")]
    ours = build_datasets(DataConfig(tuple(blend), tuple(weights), SEQ, seed, str(root / f"ours-{name}")),
                          dict(zip(("train", "valid", "test"), sizes)))
    if name == "one prefix, three epochs":
        assert ours["train"].size.epochs == 3
    for index, split_name in enumerate(("train", "valid", "test")):
        if sizes[index] == 0:
            assert ours[split_name] is None
            continue
        assert_same_samples(theirs[index], ours[split_name], sizes[index])


def test_per_split_paths_hold_megatrons_samples(corpora, one_rank_mesh):
    root, prefixes = corpora
    per_split = [[prefixes["a"], prefixes["c"]], [prefixes["b"]], None]
    theirs = megatron_datasets(root, None, None, 4, [80, 16, 0], per_split=per_split)
    ours = build_datasets(DataConfig((), seq_length=SEQ, seed=4, cache_dir=str(root / "ours-per-split"),
                                     per_split=((prefixes["a"], prefixes["c"]), (prefixes["b"],), ())),
                          {"train": 80, "valid": 16})
    assert_same_samples(theirs[0], ours["train"], 80)
    assert_same_samples(theirs[1], ours["valid"], 16)


def test_the_order_does_not_depend_on_the_run_length(corpora):
    """Megatron's order is fixed by the epochs a run needs: a run of 30 samples and one of 50
    read the same first 30 samples when both fit in one epoch (dtmega used to draw a permutation
    of only the samples needed, so its order changed with --train-iters)."""
    root, prefixes = corpora
    short, long = (build_datasets(DataConfig((prefixes["c"],), (1.0, 0.0, 0.0), SEQ, 3, str(root / f"len-{n}")),
                                  {"train": n})["train"] for n in (30, 50))
    assert all(np.array_equal(short[i], long[i]) for i in range(30))


def test_a_blend_without_weights_shorter_than_the_run_is_refused(corpora):
    """Megatron blends one epoch of each dataset when no weights are given; a longer run would
    make its loader run dry: refused here with the fix."""
    root, prefixes = corpora
    from dtmega.kernels.errors import DtmegaError

    with pytest.raises(DtmegaError, match="gives no weights.*Fix: give weights"):
        build_datasets(DataConfig((prefixes["a"], prefixes["b"]), (1.0, 0.0, 0.0), SEQ, 3, str(root / "short")),
                       {"train": 10_000})
