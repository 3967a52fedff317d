"""Messages that named the wrong thing (issue 47, item 8): a Hub id given as `--load-hf` is named
as one (dtmega never downloads; the fix is the download command and the local directory), not as
a missing `--tokenizer-model` the user never passed; the dry run's title names a mixture of experts
as one, not as a plain "Llama"."""

from __future__ import annotations

import pytest

from dtmega.cli import main
from tests.train_helpers import prepare_corpus, tiny_args

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("command", [
    ["train", "--load-hf", HUB_ID, "--data-path", "x", "--train-iters", "2", "--lr", "1e-4", "--dry-run", "1"],
    ["serve", "--load-hf", HUB_ID],
    ["convert", "hf-to-dtmega", "--hf-dir", HUB_ID, "--save", "unused-output"],
])
def test_a_hub_id_is_named_as_one_with_the_download_as_the_fix(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such relative directory here
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "looks like a Hugging Face Hub id" in err and "never downloads" in err, err
    assert f"huggingface-cli download {HUB_ID} --local-dir models/SmolLM2-135M-Instruct" in err
    flag = "--hf-dir" if command[0] == "convert" else "--load-hf"
    assert f"{flag} {HUB_ID} is not a local directory" in err and f"and pass {flag} models/" in err
    assert "--tokenizer-model" not in err
    assert not (tmp_path / "unused-output").exists()


def test_the_dry_run_title_names_a_mixture_of_experts(tmp_path, capsys):
    corpus = prepare_corpus(tmp_path, documents=60)
    line = tiny_args(corpus, num_experts=4, moe_router_topk=2)
    assert main(["train", *line, "--dry-run", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table's title may wrap
    assert "dry run: Llama with a mixture of experts (4 experts, top-2) on" in out, out[:2000]
