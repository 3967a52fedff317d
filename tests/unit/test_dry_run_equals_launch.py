"""`--dry-run` checks what a launch checks (issue 32, item 2): ten bad lines, each refused with the
same one-line message by `dtmega train ... --dry-run N` and by a launch of N ranks, before any
process group. The launch is `dtmega train` in this process with torchrun's environment for rank
0 of N (the code path of a real launch up to its first collective); one line is also launched
with torchrun itself, whose failure summary (printed last) names dtmega's line as the root cause."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtmega.cli import main
from tests.train_helpers import prepare_corpus, tiny_args

BAD_LINES = {
    "quoted junk split": dict(split="'9x,1,0'"),
    "unknown tokenizer type": dict(tokenizer_type="NoSuchTokenizer"),
    "heads not divisible by TP": dict(hidden_size=96, num_attention_heads=6, num_query_groups=6,
                                      tensor_model_parallel_size=4),
    "width not divisible by heads": dict(num_attention_heads=6, num_query_groups=3),
    "global batch not divisible": dict(global_batch_size=3, micro_batch_size=1),
    "negative learning rate": dict(lr=-1.0),
    "missing dataset": dict(data_path="no/such/corpus_text_document"),
    "query groups not dividing heads": dict(num_query_groups=3),
    "unknown flag": dict(no_such_flag=True),
    "pipeline deeper than the model": dict(pipeline_model_parallel_size=2, num_layers=1, global_batch_size=16,
                                           untie_embeddings_and_output_weights=True),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("bad_lines"), documents=60)


def _message(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("dtmega train: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name", BAD_LINES)
def test_a_dry_run_and_a_launch_give_the_same_message(name, corpus, capsys, monkeypatch, tmp_path):
    line = tiny_args(corpus, save=str(tmp_path / "ckpt"), **BAD_LINES[name])
    world = str(4 if "tensor_model_parallel_size" in BAD_LINES[name] else 2)
    assert main(["train", *line, "--dry-run", world]) == 2
    dry = _message(capsys.readouterr().err)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no rendezvous: the error comes before any
    assert main(["train", *line]) == 2
    launched = _message(capsys.readouterr().err)
    assert launched == dry
    assert "Fix" in dry or "did you mean" in dry or "choose from" in dry or "must be" in dry, dry
    assert not (tmp_path / "ckpt").exists()  # nothing written


def test_under_torchrun_the_summary_printed_last_names_dtmegas_line(corpus, tmp_path):
    line = tiny_args(corpus, **BAD_LINES["quoted junk split"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
                           "-m", "dtmega", "train", *line], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    output = (done.stdout + done.stderr).rstrip().splitlines()
    message = "--split \"'9x,1,0'\" must be up to three numbers"  # "dtmega train: [rank N: ]" before it
    root_cause = output[output.index("Root Cause (first observed failure):"):]
    assert any(message in row and "traceback :" in row for row in root_cause), "\n".join(output[-20:])
    assert "Traceback" not in "\n".join(output[:output.index("Traceback (most recent call last):")] if
                                        "Traceback (most recent call last):" in output else output)
