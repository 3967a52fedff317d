"""`--dry-run` gives the launch's verdict on the data too (issue 47, item 1): a validation part shorter
than a sample, a --split with no training documents, a blend component too short for a sample,
ids the tokenizer does not have, an empty --train-data-path, a zero blend weight. Before, the dry
run said "Arguments, files and plan check out" and the launch stopped seconds later. Each line is
refused with the same one line by `dtmega train ... --dry-run 2` and by a launch of rank 0 of 2
(no rendezvous: the refusal comes before any process group). And a run whose validation part is
empty says so at start, in the dry run and the launch (item 7), instead of promising validation."""

from __future__ import annotations

import numpy as np
import pytest

from dtmega.cli import main
from dtmega.data.indexed import IndexedDatasetWriter
from tests.train_helpers import tiny_args

EOD = 256  # the byte tokenizer's end of document


def _write(prefix, documents: int, length: int, seed: int = 0) -> str:
    writer = IndexedDatasetWriter(prefix, np.uint16)
    rng = np.random.RandomState(seed)
    for _ in range(documents):
        writer.add_document([np.append(rng.randint(0, 256, size=length - 1), EOD)])
    writer.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dry_run_data")
    return {"big": _write(root / "big_text_document", 100, 40), "short": _write(root / "short_text_document", 3, 10),
            "empty": _write(root / "empty_text_document", 0, 1)}


BAD_LINES = {
    # 2 of 100 documents of 40 tokens: 80 tokens, fewer than one sample of 128 + 1
    "validation part shorter than a sample": (lambda d: dict(data_path=d["big"], split="98,2,0", seq_length=128),
                                              "the valid split of"),
    "no training documents": (lambda d: dict(data_path=d["big"], split="0,99,1"), "leaves no training documents"),
    "blend component shorter than a sample": (lambda d: dict(data_path=f"0.5 {d['big']} 0.5 {d['short']}",
                                                             split="100,0,0"), "the train split of"),
    "ids beyond the tokenizer": (lambda d: dict(data_path=d["big"], tokenizer_type="NullTokenizer", vocab_size=100),
                                 "token id"),
    "empty training data path": (lambda d: dict(data_path=None, train_data_path=d["empty"], valid_data_path=d["big"]),
                                 "holds no documents"),
    "zero blend weight": (lambda d: dict(data_path=f"0 {d['big']} 1 {d['big']}"), "weights must be positive"),
}


def _line(name: str, data, tmp_path) -> list[str]:
    values = BAD_LINES[name][0](data)
    blend = (values["data_path"] or "").split()
    line = tiny_args("", save=str(tmp_path / "ckpt"), **values)  # data_path None: no --data-path
    if len(blend) > 1:  # a weighted blend: one flag, several values
        at = line.index("--data-path")
        line[at + 1:at + 2] = blend
    return line


def _message(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("dtmega train: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name", BAD_LINES)
def test_the_dry_run_refuses_the_data_the_launch_refuses(name, data, capsys, monkeypatch, tmp_path):
    line = _line(name, data, tmp_path)
    assert main(["train", *line, "--dry-run", "2"]) == 2
    captured = capsys.readouterr()
    dry = _message(captured.err)
    assert "check out" not in captured.out
    assert BAD_LINES[name][1] in dry, dry
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no rendezvous: the refusal must come before any
    assert main(["train", *line]) == 2
    assert _message(capsys.readouterr().err) == dry
    assert not (tmp_path / "ckpt").exists()  # nothing written


def test_an_empty_validation_part_is_said_at_start_by_the_dry_run_and_the_launch(data, capfd):
    """--split 995,4,1 over 100 documents gives the validation part round(0.4) = 0 documents: the
    run used to announce validation and then run none, silently."""
    line = tiny_args(data["big"], split="995,4,1", train_iters=2, eval_interval=1, eval_iters=2)
    assert main(["train", *line, "--dry-run", "1"]) == 0
    out = capfd.readouterr().out
    assert "no validation will run: --split 995,4,1" in out and "--eval-iters 0" in out
    assert "validation will cost" not in out
    from dtmega.train.trainer import train

    result = train(line)
    assert result.validation == []
    err_and_out = "".join(capfd.readouterr())
    assert "no validation will run" in err_and_out
    assert err_and_out.index("no validation will run") < err_and_out.index("loss")  # before the first step's line


@pytest.mark.parametrize("dry_run", [[], ["2"]], ids=["bare", "for two ranks"])
def test_a_dry_run_plans_a_sample_index_past_this_machines_memory_and_a_launch_refuses_it(
        data, dry_run, monkeypatch, capsys, tmp_path):
    """docs/reliability.md: a sample index past half this machine's memory is refused by a launch
    before any index is built; a dry run plans for another machine and does not refuse it. A bare
    `--dry-run` parses to 0, which the check once read as "not a dry run"."""
    from dtmega.data import gpt_dataset

    monkeypatch.setattr(gpt_dataset, "_memory_bytes", lambda: 2**20)  # a 1 MiB machine
    line = tiny_args(data["big"], save=str(tmp_path / "ckpt"), train_iters=10**5)
    assert main(["train", *line, "--dry-run", *dry_run]) == 0, capsys.readouterr().err
    capsys.readouterr()
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # the refusal comes before any rendezvous
    assert main(["train", *line]) == 2
    assert "more than half this machine's" in _message(capsys.readouterr().err)
    assert not list(tmp_path.rglob("*.dtmega-index*"))
