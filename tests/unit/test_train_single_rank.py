"""`dtmega train` in a world of one: checkpoint atomicity, resume errors, data checks, CLI."""

from __future__ import annotations

import json
import random
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dtmega.data.indexed import IndexedDatasetWriter
from dtmega.data.preprocess import PreprocessConfig, preprocess
from dtmega.train.args import ArgumentError
from dtmega.train.checkpoint import CheckpointError, resolve_checkpoint
from dtmega.train.restore import restore
from dtmega.train.trainer import train
from tests.corpus import write_jsonl
from tests.train_helpers import prepare_corpus, tiny_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=200)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(corpus, tmp_path):
    save = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, signal
        import torch.distributed.checkpoint as dcp
        real_save = dcp.save
        calls = []
        def save_then_die(*args, **kwargs):
            real_save(*args, **kwargs)
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # shards written, not yet renamed
        dcp.save = save_then_die
        from dtmega.train.trainer import train
        train({tiny_args(corpus, train_iters=4, save=str(save), save_interval=1)!r})
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-2000:]
    assert resolve_checkpoint(save).name == "iter_0000001"
    assert (save / ".iter_0000002.partial").exists() and not (save / "iter_0000002").exists()
    pm, _, state = restore(save)
    assert state["iteration"] == 1
    resumed = train(tiny_args(corpus, train_iters=3, save=str(save), save_interval=1, load=str(save)))
    assert len(resumed.losses) == 2 and resolve_checkpoint(save).name == "iter_0000003"
    assert not (save / ".iter_0000002.partial").exists()


def test_checkpoint_from_another_model_lists_the_differences(corpus, tmp_path, monkeypatch):
    """docs/reliability.md, Checkpoints: a checkpoint of another model gives "the list of
    mismatched names and shapes, before any I/O": DCP's load is made to fail, and the list still
    comes (from `.metadata` alone, before any tensor is read)."""
    train(tiny_args(corpus, train_iters=1, save=str(tmp_path / "ckpt")))
    monkeypatch.setattr("dtmega.train.checkpoint.load_dcp",
                        lambda *a, **k: pytest.fail("a tensor was read before the shapes were compared"))
    with pytest.raises(CheckpointError) as caught:
        train(tiny_args(corpus, train_iters=2, hidden_size=128, ffn_hidden_size=256, load=str(tmp_path / "ckpt")))
    message = str(caught.value)
    assert "saved from a different model" in message
    assert "tok_embeddings.weight: checkpoint (384, 64) vs model (384, 128)" in message  # tied: held once
    assert "layers.0.feed_forward.w1.weight: checkpoint (128, 64) vs model (256, 128)" in message


def test_missing_or_empty_load_paths(corpus, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        train(tiny_args(corpus, load=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        train(tiny_args(corpus, load=str(tmp_path / "empty")))


def test_data_tokenized_with_a_larger_vocabulary(tmp_path):
    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8))) for _ in range(3000)]
    source = write_jsonl(tmp_path / "in.jsonl", [" ".join(rng.sample(words, 40)) for _ in range(400)])
    result = preprocess(PreprocessConfig(input=source, output_prefix=str(tmp_path / "bpe"), train_tokenizer=1000,
                                         append_eod=True, progress=False))
    from dtmega.data.vocab_check import DataVocabularyError

    with pytest.raises(DataVocabularyError, match=r"holds token id \d+, but this run's tokenizer has 258 ids"):
        train(tiny_args(result.outputs["text"]))


@pytest.mark.parametrize("sidecar", [True, False], ids=["with_stats_json", "megatron_made_without_stats_json"])
def test_data_with_ids_in_the_vocabulary_padding_is_refused(corpus, tmp_path, sidecar, capsys):
    """Ids 258..383 fit the byte tokenizer's padded vocabulary (384) but are no byte tokens:
    data from another tokenizer would train (and evaluate) silently. One rule for train and
    evaluate: the check is against the tokenizer's 258, from the `.stats.json` sidecar or, for
    data without one (Megatron's preprocess writes none), from a scan cached beside the data."""
    from dtmega.cli import main as dtmega_main
    from dtmega.data.indexed import stats_path
    from dtmega.data.vocab_check import DataVocabularyError

    prefix = tmp_path / "other_text_document"
    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.RandomState(0)
    for _ in range(100):
        writer.add_document([rng.randint(0, 352, size=64)])
    writer.finalize()
    if not sidecar:
        stats_path(prefix).unlink()
    with pytest.raises(DataVocabularyError, match=r"holds token id 351, but this run's tokenizer has 258 ids.*Fix: pass "
                                                  r"the tokenizer the data was preprocessed with"):
        train(tiny_args(str(prefix)))
    assert sidecar or list(Path(f"{prefix}.dtmega-index").glob("max-token-id-*.json"))  # scanned once, cached
    checkpoint = tmp_path / "ckpt"
    train(tiny_args(corpus, train_iters=1, save=str(checkpoint), eval_iters=1))
    capsys.readouterr()
    assert dtmega_main(["evaluate", "--load", str(checkpoint), "--data-path", str(prefix), "--eval-iters", "1"]) == 2
    assert "holds token id 351, but the checkpoint's tokenizer has 258 ids" in capsys.readouterr().err


def test_train_cli_errors_exit_2_with_the_reason(corpus):
    command = [sys.executable, "-m", "dtmega", "train", *tiny_args(corpus, global_batch_size=7)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--global-batch-size 7 is not divisible by --micro-batch-size 2" in done.stderr


def test_metrics_reach_jsonl_and_tensorboard(corpus, tmp_path):
    log, board = tmp_path / "metrics.jsonl", tmp_path / "tb"
    result = train(tiny_args(corpus, train_iters=6, log_interval=3, eval_interval=3, log_file=str(log),
                             tensorboard_dir=str(board)))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [3, 6]
    for key in ("lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "memory_gib", "consumed_samples"):
        assert all(isinstance(r[key], (int, float)) for r in steps), key
    validation = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in validation] == [3, 6] and validation[-1]["val_loss"] == result.validation[-1][1]
    assert list(board.glob("events.out.tfevents.*"))


def test_console_script_and_module_entry_points():
    script = Path(sys.executable).with_name("dtmega")
    for command in ([str(script), "--help"], [sys.executable, "-m", "dtmega", "--help"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "preprocess" in done.stdout and "generate" in done.stdout
    done = subprocess.run([str(script), "fly"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown command 'fly'" in done.stderr


def test_a_dry_run_checks_a_launch_for_many_ranks_without_running_it(corpus, tmp_path, capsys):
    save = tmp_path / "never-written"
    assert train([*tiny_args(corpus, tensor_model_parallel_size=2, use_distributed_optimizer=True, save=str(save),
                             global_batch_size=64), "--dry-run", "64"]) is None
    out = capsys.readouterr().out
    assert "dry run for 64 ranks" in out and "DP 32 x CP 1 x TP 2" in out and "nothing ran" in out
    assert not save.exists()
    # 8 global sequences do not split over 32 data-parallel ranks: refused before anything runs.
    with pytest.raises(ArgumentError, match="global-batch-size 8 is not divisible"):
        train([*tiny_args(corpus, tensor_model_parallel_size=2, global_batch_size=8, micro_batch_size=2),
               "--dry-run", "64"])
    with pytest.raises(ArgumentError, match="seq-length 64 is longer than --max-position-embeddings 32"):
        train([*tiny_args(corpus, seq_length=64, max_position_embeddings=32), "--dry-run", "4"])
