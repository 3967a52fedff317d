"""Docs that run: every code block of README.md and docs/*.md is run, checked as an excerpt of a
named file, or skipped with a stated reason (tests/doc_blocks.py says how each kind is run and
how GPU-sized commands are scaled). A doc that stops working fails CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.corpus import make_texts, write_jsonl
from tests.doc_blocks import ROOT, code_blocks, commands, excerpt_missing, one_process_dtmega_argv, scale_command
from tests.task_models import LAMBADA_PASSAGES, wikitext_sample
from tests.train_helpers import LLAMA_BLOCK

BLOCKS = code_blocks()
RUN = [b for b in BLOCKS if b.action in ("run", "excerpt")]
PYTHON = sys.executable
TIMEOUT = 420


def _run(command: str | list[str], cwd: Path, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200",
           "PATH": f"{Path(PYTHON).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    shell = isinstance(command, str)
    return subprocess.run(command, cwd=cwd, env=env, shell=shell, capture_output=True, text=True, timeout=timeout,
                          executable="/bin/bash" if shell else None)


def _check(done: subprocess.CompletedProcess, what: str) -> None:
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A working directory like a user's: the repo's configs/examples/benchmarks, corpora in
    JSONL, the demo corpus and a small one tokenized, a tiny checkpoint `ckpt`, and the
    evaluation tasks' files (wiki.test.tokens, lambada_test.jsonl)."""
    root = tmp_path_factory.mktemp("docs")
    for name in ("configs", "examples", "benchmarks"):
        (root / name).symlink_to(ROOT / name)
    # the corpora GPU-sized lines are dry-run on are long enough for them: --dry-run checks every
    # split as the launch does, and the validation part of --split 969,30,1 must hold one sample
    # (data: 1.3 M tokens, for the README's 32768-token line; web and code: 290 K, for 8192)
    for name, seed, documents, words in (("data", 1, 9000, (80, 220)), ("corpus", 1, 300, (5, 60)),
                                         ("heldout", 2, 300, (5, 60)), ("web", 3, 9000, (5, 60)),
                                         ("code", 4, 9000, (5, 60))):
        write_jsonl(root / f"{name}.jsonl", make_texts(documents, seed=seed, words=words))
    import importlib.util

    kjv = Path(importlib.util.find_spec("bible").submodule_search_locations[0]) / "data" / "kjv.jsonl"
    steps = [
        [PYTHON, "-m", "dtmega", "preprocess", "--input", "data.jsonl", "--json-keys", "text", "--output-prefix",
         "data/corpus", "--train-tokenizer", "32000", "--append-eod", "--workers", "2"],
        [PYTHON, "-m", "dtmega", "preprocess", "--input", str(kjv), "--json-keys", "text", "--output-prefix",
         "runs/demo/data/kjv", "--train-tokenizer", "8192", "--append-eod", "--workers", "2"],
        [PYTHON, "-m", "dtmega", "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
         "--lr", "1e-3", "--data-path", "data/corpus_text_document", "--split", "90,10,0",
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "data/tokenizer.json", "--save", "ckpt",
         "--eval-iters", "1", *LLAMA_BLOCK],  # a Llama checkpoint: the pages convert it to LlamaForCausalLM
    ]
    for step in steps:
        _check(_run(step, root), " ".join(step[1:5]))
    # the evaluation tasks' files (docs/evaluation.md): a WikiText-style text and LAMBADA passages
    (root / "wiki.test.tokens").write_text(wikitext_sample(words=400))
    (root / "lambada_test.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in LAMBADA_PASSAGES))
    return root


def test_every_code_block_says_how_the_suite_runs_it():
    unmarked = [b.name for b in BLOCKS if not b.action]
    assert not unmarked, f"doc blocks without a <!-- doc: run|excerpt|skip --> marker: {unmarked}"
    for block in BLOCKS:
        if block.action == "skip":
            assert len(block.argument) >= 10, f"{block.name}: a skipped block needs its reason"
        if block.action == "excerpt":
            assert (ROOT / block.argument).is_file(), f"{block.name}: excerpt of {block.argument!r}, no such file"
    assert len(RUN) >= 10


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_doc_block(block, sandbox):
    if block.action == "excerpt":
        missing = excerpt_missing(block)
        assert missing is None, f"{block.name} is marked an excerpt of {block.argument}, but {missing!r} is not there"
    elif block.language == "python":
        script = sandbox / f"block_{block.path.stem}_{block.line}.py"
        script.write_text(block.code + "\n")
        launch = [PYTHON, str(script)] if block.ranks == 1 else \
            [str(Path(PYTHON).with_name("torchrun")), "--nproc-per-node", str(block.ranks), str(script)]
        _check(_run(launch, sandbox), block.name)
    elif block.language in ("bash", "sh"):
        out = sandbox / "benchmark-results"
        batch: list[list[str]] = []  # consecutive one-process dtmega commands share a process

        def flush() -> None:
            if batch:
                _check(_run([PYTHON, str(ROOT / "tests" / "dtmega_commands.py"), json.dumps(batch)], sandbox),
                       f"{block.name}: {batch}")
                batch.clear()

        for command in commands(block.code):
            scaled = scale_command(command, PYTHON, out)
            argv = one_process_dtmega_argv(scaled, PYTHON)
            if argv is not None:
                batch.append(argv)
                continue
            flush()
            _check(_run(f"head=localhost; SLURM_JOB_ID=1; {scaled}", sandbox), f"{block.name}: {scaled}")
        flush()
    elif block.language == "toml":
        from dtmega.passes.toml_io import load_toml

        load_toml(block.code)
    else:
        pytest.fail(f"{block.name}: no way to run a {block.language} block")
