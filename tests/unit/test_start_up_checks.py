"""`dtmega train`'s start-up checks of --save and --load (issue 18's checkpoint paths): what
used to be found only when the first save failed, after the training it was meant to keep."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dtmega.train import checkpoint_paths
from dtmega.train.args import ArgumentError, parse_train_args
from dtmega.train.checkpoint import CheckpointError, resolve_checkpoint
from dtmega.train.checkpoint_manifest import MANIFEST, file_checksum
from dtmega.train.restore import read_head
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


def test_load_equal_to_save_starts_fresh_then_resumes(corpus, tmp_path, capsys):
    """Megatron's launch scripts pass one directory as --save and --load: the first run starts
    from scratch with a notice (the directory need not exist), a restart resumes from it (that a
    resume reproduces the uninterrupted losses is test_training.py's and
    test_a_save_killed_midway_leaves_the_previous_checkpoint's)."""
    both = str(tmp_path / "run" / "checkpoints")
    first = train(tiny_args(corpus, train_iters=2, save=both, load=both, save_interval=1))
    assert "holds no checkpoint yet: starting from scratch" in capsys.readouterr().out
    assert first.iteration == 2 and resolve_checkpoint(both).name == "iter_0000002"
    resumed = train(tiny_args(corpus, train_iters=4, save=both, load=both, save_interval=1))
    assert "resumed from" in capsys.readouterr().out
    assert len(resumed.losses) == 2 and resumed.iteration == 4
    assert resolve_checkpoint(both).name == "iter_0000004"
    done = train(tiny_args(corpus, train_iters=3, save=both, load=both, save_interval=1))
    assert "nothing to train: the checkpoint is at step 4 and --train-iters is 3" in capsys.readouterr().out
    assert done.losses == [] and done.iteration == 4 and resolve_checkpoint(both).name == "iter_0000004"


def test_an_empty_load_elsewhere_is_still_an_error(corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        train(tiny_args(corpus, load=str(tmp_path / "empty"), save=str(tmp_path / "out")))


@pytest.mark.parametrize("where, message", [
    ("under_a_file", r"--save .*a_file/ckpt: .*a_file is a file, not a directory"),
    ("proc", r"--save /proc/dtmega-test/ckpt is not writable"),
])
def test_an_unusable_save_is_refused_before_training(corpus, tmp_path, where, message, monkeypatch):
    if where == "under_a_file":
        (tmp_path / "a_file").write_text("x")
        save = tmp_path / "a_file" / "ckpt"
    else:
        save = Path("/proc/dtmega-test/ckpt")
    steps = []
    monkeypatch.setattr("dtmega.train.trainer.Trainer.run", lambda self: steps.append(1))
    with pytest.raises(CheckpointError, match=message):
        train(tiny_args(corpus, save=str(save)))
    assert steps == []  # refused before the run


def test_a_save_without_room_for_one_checkpoint_is_refused(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_paths.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    """Sizes in the unit that says something (before: "0.00 GiB free, takes about 0.00 GiB")."""
    with pytest.raises(CheckpointError, match=r"has 1000 B free, but one checkpoint of this model takes about "
                                              r"[\d.]+ MiB \([\d,]+ parameters x 12 bytes"):
        train(tiny_args(corpus, save=str(tmp_path / "ckpt")))


def test_a_dry_run_warns_of_too_little_room(corpus, tmp_path, monkeypatch, capsys):
    """A dry run (a launch line checked on a login node, days before the run) says that there is
    too little room today, and still passes."""
    monkeypatch.setattr(checkpoint_paths.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    train(tiny_args(corpus, save=str(tmp_path / "ckpt"), dry_run=1))
    assert "note: today --save" in capsys.readouterr().out and not (tmp_path / "ckpt").exists()


def test_dry_run_checks_save_without_creating_it(corpus, tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        train(tiny_args(corpus, save=str(tmp_path / "a_file" / "c"), dry_run=1))
    train(tiny_args(corpus, save=str(tmp_path / "new" / "ckpt"), dry_run=1))
    assert not (tmp_path / "new").exists()


class _RunsCode:
    """Pickles to a call of print: what a checkpoint from someone else could hold instead."""

    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_rng_states_are_loaded_as_data_only(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    train(tiny_args(corpus, train_iters=2, save=str(save)))
    rng_file = resolve_checkpoint(save) / "rng_rank00000.pt"
    buffer = io.BytesIO()
    torch.save({"cpu": torch.get_rng_state(), "cuda": [], "payload": _RunsCode()}, buffer)
    rng_file.write_bytes(buffer.getvalue())
    manifest = json.loads((rng_file.parent / MANIFEST).read_text())  # a forged checkpoint forges its manifest too
    size, crc = file_checksum(rng_file)
    manifest["files"][rng_file.name] = {"size": size, "crc32": crc}
    (rng_file.parent / MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    with pytest.raises(CheckpointError, match=r"rng_rank00000.pt holds more than RNG state tensors .*weights_only"):
        train(tiny_args(corpus, train_iters=3, save=str(save), load=str(save)))
    assert "unpickled code ran" not in capsys.readouterr().out


def test_an_unknown_flag_is_one_line_with_the_closest_flags(corpus):
    """An ArgumentError (one line from the CLI, exit 2) instead of argparse's usage of ~150 flags."""
    with pytest.raises(ArgumentError) as caught:
        parse_train_args([*tiny_args(corpus), "--trian-iters", "5"])
    message = str(caught.value)
    assert message.startswith("unrecognized arguments: --trian-iters 5 (--trian-iters: did you mean --train-iters")
    assert "\n" not in message and "usage" not in message


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    save = tmp_path_factory.mktemp("generate") / "ckpt"
    train(tiny_args(corpus, train_iters=2, save=str(save)))
    return save


def test_generate_beyond_the_context_is_refused_before_loading(checkpoint, monkeypatch):
    """Before: a shape error past the context, or an attempt at a 25.6 GB KV cache."""
    from dtmega.train import generate

    monkeypatch.setattr(generate, "restore_with_progress", lambda *a, **k: pytest.fail("loaded the weights before checking"))
    context = read_head(checkpoint).config.max_seq_len
    with pytest.raises(ValueError, match=rf"the prompt \(\d+ tokens\) \+ --max-new-tokens 100000000 = \d+ tokens "
                                         rf"exceeds the model's context of {context} tokens.*Fix: --max-new-tokens \d+"):
        generate.main(["--load", str(checkpoint), "--prompt", "And God said", "--max-new-tokens", "100000000"])


def test_generate_refuses_a_prompt_that_is_not_utf8(checkpoint):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates
    (surrogateescape): b"caf\\xe9" arrives as "caf\\udce9"."""
    from dtmega.train import generate

    with pytest.raises(ValueError, match=r"--prompt holds bytes that are not UTF-8 text \(from character 3"):
        generate.main(["--load", str(checkpoint), "--prompt", "caf\udce9 au lait"])


# ---- the weak cases of the second fault matrix (../shared/reliability/matrix-2.md), one line each ----

def test_blend_weights_whose_sum_overflows_are_normalised(tmp_path):
    """N48: `--data-path 1e308 A 1e308 B` was a ZeroDivisionError."""
    from dtmega.data.blend import parse_data_path

    assert parse_data_path(["1e308", "a", "1e308", "b"]) == [(0.5, "a"), (0.5, "b")]


@pytest.mark.parametrize("flags, message", [
    (["--lr", "-1e-3"], r"--lr -0.001: must be 0 or more"),  # N50: was "expected one argument"
    (["--adam-beta2", "1.5"], r"--adam-beta2 1.5: must be at least 0 and below 1. Fix: pass a value in \[0, 1\), "
                              r"e.g. 0.999"),  # N51: was torch's message, after the model was built
    (["--adam-beta1", "-0.1"], r"--adam-beta1 -0.1: must be at least 0 and below 1"),
])
def test_flag_values_are_refused_naming_the_flag(corpus, flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_train_args([*tiny_args(corpus), *flags])


@pytest.mark.parametrize("flag, where, message", [
    ("log_file", "/proc/dtmega-test/m.jsonl", r"--log-file /proc/dtmega-test/m.jsonl: cannot write there"),  # N56
    ("tensorboard_dir", "a_file/tb", r"--tensorboard-dir .*a_file/tb: cannot write there \(.*\). Fix: pass a "
                                     r"--tensorboard-dir directory on a writable filesystem"),  # N57
    ("log_file", ".", r"--log-file .* is a directory; it takes a file name"),
])
def test_outputs_are_checked_before_the_run(corpus, tmp_path, monkeypatch, flag, where, message):
    (tmp_path / "a_file").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dtmega.train.trainer.init_distributed",
                        lambda *a, **k: pytest.fail("the process group came before the check"))
    with pytest.raises(ArgumentError, match=message):
        train(tiny_args(corpus, **{flag: where}))


def test_evaluate_refuses_a_sequence_beyond_the_context(checkpoint, corpus, capsys):
    """N52: `evaluate --seq-length 128` on a 64-position model was an IndexError."""
    from dtmega.cli import main as dtmega_main

    context = read_head(checkpoint).config.max_seq_len
    capsys.readouterr()
    assert dtmega_main(["evaluate", "--load", str(checkpoint), "--data-path", corpus,
                        "--seq-length", str(2 * context), "--eval-iters", "1"]) == 2
    assert (f"--seq-length {2 * context} is longer than the model's context of {context} tokens" in
            capsys.readouterr().err)


def test_a_run_says_what_its_validation_will_cost_when_it_is_a_noticeable_share(corpus, capsys):
    """Issue 32: Megatron's default --eval-iters 100 after a 3-minute fine-tune ran 12 minutes.
    10 steps with one final validation of 100 batches: 100 / 3 / 10, about 333 %; with
    --eval-iters 2 the share is 7 % and nothing is said."""
    from dtmega.train.trainer import train

    train(tiny_args(corpus, train_iters=10, eval_iters=100, eval_interval=1000, dry_run=1))
    assert ("validation will cost about 333% of the training's compute: 1 validation(s) of --eval-iters 100"
            in capsys.readouterr().out)
    train(tiny_args(corpus, train_iters=10, eval_iters=2, eval_interval=1000, dry_run=1))
    assert "validation will cost" not in capsys.readouterr().out


def test_evaluate_of_a_run_takes_the_runs_sequence_length(checkpoint, corpus, capsys):
    """The other half of the one length rule (test_hf_checkpoints.py has the Hugging Face half)."""
    from dtmega.cli import main as dtmega_main
    from dtmega.train.checkpoint import read_state, resolve_checkpoint

    run_length = read_state(resolve_checkpoint(checkpoint))["args"]["seq_length"]
    capsys.readouterr()
    assert dtmega_main(["evaluate", "--load", str(checkpoint), "--data-path", corpus, "--eval-iters", "1"]) == 0
    assert f"samples of {run_length} tokens (the training run's --seq-length" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "nan", "1000"])
def test_generate_refuses_a_temperature_that_means_nothing(checkpoint, capsys, value):
    """N55: `--temperature -1` decoded greedily without a word (the server refused it)."""
    from dtmega.cli import main as dtmega_main

    capsys.readouterr()
    assert dtmega_main(["generate", "--load", str(checkpoint), "--prompt", "a", "--temperature", value]) == 2
    assert f"--temperature {float(value)}: must be 0 (greedy, as --greedy) or a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("items", [["0", "a", "0", "b"], ["nan", "a", "1", "b"]], ids=["N46_zero_weights", "N47_nan"])
def test_blend_weights_that_mean_nothing_are_refused(items):
    from dtmega.data.blend import parse_data_path
    from dtmega.kernels.errors import DtmegaError

    with pytest.raises(DtmegaError, match=r"--data-path weights must be positive numbers"):
        parse_data_path(items)


def test_a_data_path_given_with_bin_names_the_prefix_convention(corpus):
    """N58: `--data-path X.bin` says to pass the prefix without .bin/.idx."""
    with pytest.raises(Exception, match=r"_text_document\.bin\.idx does not exist. Fix: pass the prefix without "
                                        r"\.bin/\.idx"):
        train(tiny_args(f"{corpus}.bin"))


def test_a_save_interval_of_zero_is_refused(corpus, tmp_path):
    """N59."""
    with pytest.raises(ArgumentError, match=r"--save-interval 0: must be at least 1"):
        parse_train_args([*tiny_args(corpus, save=str(tmp_path / "c")), "--save-interval", "0"])


def test_generate_load_of_a_file_holds_no_checkpoint(tmp_path, capsys):
    """N64."""
    from dtmega.cli import main as dtmega_main

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    capsys.readouterr()
    assert dtmega_main(["generate", "--load", str(tmp_path / "metrics.jsonl"), "--prompt", "the"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_plan_refuses_zero_gpus(capsys):
    """N65: `dtmega plan --gpus 0` is one line (exit 2)."""
    from dtmega.cli import main as dtmega_main

    capsys.readouterr()
    assert dtmega_main(["plan", "--model", "llama3-8b", "--gpus", "0", "--seq-length", "8192",
                        "--global-batch-size", "128"]) == 2
    assert "--gpus must be a positive integer, got 0" in capsys.readouterr().err


def test_load_hf_with_a_sequence_past_its_positions_is_refused_before_the_run(corpus, tmp_path):
    """N29: `train --load-hf` with --seq-length longer than the model's position table."""
    from tests.hf_models import save_tiny_llama31

    hf = save_tiny_llama31(tmp_path / "hf")  # 256 positions
    argv = tiny_args(corpus, load_hf=str(hf), seq_length=512, train_iters=1, num_layers=None, hidden_size=None,
                     ffn_hidden_size=None, num_attention_heads=None, num_query_groups=None)
    argv = [flag for flag in argv if flag not in ("--group-query-attention", "--swiglu")]  # the config says
    with pytest.raises(Exception, match=r"sequence length 512 is longer than the model's position table \(256 "
                                        r"positions\)"):
        train(argv)


def _start_up_faults(corpus: str, tmp_path: Path) -> list[tuple[dict, str]]:
    """One fault of each item of docs/reliability.md's start-up list, in its order, each with the
    start of the line it is refused with (a launch of rank 0 of 4)."""
    (tmp_path / "a_file").write_text("x")
    return [
        (dict(adam_beta2=1.5), "--adam-beta2 1.5: must be at least 0"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "nowhere" / "tokenizer.json")),
         "--tokenizer-model (tokenizer.json"),
        (dict(global_batch_size=7), "--global-batch-size 7 is not divisible"),
        (dict(seq_length=64, max_position_embeddings=32), "--seq-length 64 is longer than --max-position-embeddings"),
        (dict(data_path=str(tmp_path / "nowhere_text_document")), f"{tmp_path / 'nowhere_text_document'}.idx does not"),
        (dict(ffn_hidden_size=130, tensor_model_parallel_size=4, global_batch_size=2),
         "--ffn-hidden-size 130 is not divisible by --tensor-model-parallel-size 4"),
        (dict(save=str(tmp_path / "a_file" / "ckpt")), f"--save {tmp_path / 'a_file' / 'ckpt'}:"),
    ]


def test_start_up_checks_come_in_the_documented_order(corpus, tmp_path, monkeypatch, capsys):
    """docs/reliability.md lists the start-up checks "in order": of two faults of neighbouring
    items, the earlier item's is the one refused (each fault alone is refused by its own line)."""
    from dtmega.cli import main

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no rendezvous: every check comes before one
    faults = _start_up_faults(corpus, tmp_path)

    def refusal(flags: dict) -> str:
        assert main(["train", *tiny_args(corpus, **flags)]) == 2
        return capsys.readouterr().err.strip().splitlines()[-1].removeprefix("dtmega train: ")

    for flags, line in faults:
        assert refusal(flags).startswith(line)
    for (first, line), (second, _) in zip(faults, faults[1:]):
        assert refusal({**first, **second}).startswith(line), (first, second)


def _with_vocabulary(checkpoint: Path, copy: Path, rows: int) -> Path:
    """A copy of the `checkpoint` directory whose checkpoint says its model has `rows`
    vocabulary rows (state.json and its manifest entry rewritten together, as a checkpoint of
    another vocabulary would have them)."""
    import shutil

    shutil.copytree(checkpoint, copy)
    latest = resolve_checkpoint(copy)
    state = json.loads((latest / "state.json").read_text())
    state["model_config"]["vocab_size"] = rows
    (latest / "state.json").write_text(json.dumps(state, indent=2))
    manifest = json.loads((latest / MANIFEST).read_text())
    size, crc = file_checksum(latest / "state.json")
    manifest["files"]["state.json"] = {"size": size, "crc32": crc}
    (latest / MANIFEST).write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("rows, flags, why", [
    (200, {}, r"the tokenizer has 258 tokens"),  # a checkpoint of a smaller vocabulary than the byte tokenizer's
    (386, {"dry_run": 4, "tensor_model_parallel_size": 4}, r"TP 4 needs a multiple of 4"),  # 386 rows over TP 4
])
def test_load_refuses_a_checkpoint_whose_vocabulary_cannot_serve_the_run(checkpoint, corpus, tmp_path, monkeypatch,
                                                                         rows, flags, why):
    """docs/reliability.md, start-up item 4: "`--load`: the checkpoint it will use ... its
    vocabulary", before any process group. A checkpoint with fewer vocabulary rows than the
    tokenizer has ids, or with rows that do not split over the run's TP size, is refused in one
    line naming the rows, the checkpoint and the fix; a launch makes no process group first, and
    a dry run refuses it as the launch would."""
    import re

    load = _with_vocabulary(checkpoint, tmp_path / "ckpt", rows)
    monkeypatch.setattr("dtmega.train.trainer.init_distributed",
                        lambda *a, **k: pytest.fail("the process group came before the check"))
    with pytest.raises(ArgumentError) as caught:
        train(tiny_args(corpus, train_iters=3, load=str(load), **flags))
    message = str(caught.value)
    assert message.startswith(f"the checkpoint's vocabulary ({rows} rows, {resolve_checkpoint(load)}) cannot serve "
                              "this run")
    assert re.search(why, message) and ". Fix: resume with the tokenizer the checkpoint was trained with" in message
    assert "\n" not in message
