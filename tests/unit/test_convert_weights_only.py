"""A Hugging Face directory without tokenizer files (issue 47, item 10; matrix-2 N26 refused it):
`convert hf-to-dtmega` converts the weights of `config.json` + `model.safetensors` and says that
generate/serve/evaluate will need `--tokenizer-model`; without it they stop with that fix (one
line, exit 2) before any weight is read; with it, `generate` decodes as `--load-hf` of the whole
directory does; `--load-hf` of the bare directory names the same fix; and `convert dtmega-to-hf`
writes the weights back bitwise, without tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from dtmega.cli import main as dtmega_main
from dtmega.interop.hf_checkpoint import HFCheckpoint
from dtmega.kernels.errors import MissingInput
from tests.hf_models import save_tiny_llama31
from tests.unit.test_hf_checkpoints import assert_bitwise, hf_tensors

GENERATE = ["--prompt", "In the beginning", "--greedy", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(the whole tiny Llama directory, the same weights as config.json + one model.safetensors)."""
    root = tmp_path_factory.mktemp("weights_only")
    whole = save_tiny_llama31(root / "whole")
    bare = root / "bare"
    bare.mkdir()
    shutil.copy(whole / "config.json", bare / "config.json")
    save_file(hf_tensors(whole), str(bare / "model.safetensors"), metadata={"format": "pt"})
    return whole, bare


def test_weights_convert_without_a_tokenizer_and_the_commands_ask_for_one(dirs, tmp_path, capsys):
    whole, bare = dirs
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(bare), "--save", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "no tokenizer files" in out and "--tokenizer-model" in out, out
    iteration = tmp_path / "ckpt" / "iter_0000000"
    assert not (iteration / "tokenizer.json").exists()
    assert json.loads((iteration / "state.json").read_text())["tokenizer"] == {}

    for command in (["generate", *GENERATE], ["serve", "--port", "0"]):
        assert dtmega_main([command[0], "--load", str(tmp_path / "ckpt"), *command[1:]]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # the error's one line (after "starting")
        assert "has no tokenizer.json" in err and "Fix: --tokenizer-model" in err, err

    assert dtmega_main(["generate", "--load", str(tmp_path / "ckpt"), "--tokenizer-model", str(whole / "tokenizer.json"),
                        *GENERATE]) == 0
    converted = capsys.readouterr().out
    assert dtmega_main(["generate", "--load-hf", str(whole), *GENERATE]) == 0
    assert converted.strip().splitlines()[-1] == capsys.readouterr().out.strip().splitlines()[-1]

    assert dtmega_main(["convert", "dtmega-to-hf", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "back")]) == 0
    assert_bitwise(hf_tensors(bare), hf_tensors(tmp_path / "back"))
    assert not list((tmp_path / "back").glob("tokenizer*"))


def test_load_hf_of_a_directory_without_a_tokenizer_names_the_fix(dirs, capsys):
    whole, bare = dirs
    with pytest.raises(MissingInput, match="holds neither tokenizer.json nor tokenizer.model. Fix: --tokenizer-model"):
        HFCheckpoint.open(bare)
    assert HFCheckpoint.open(bare, str(whole / "tokenizer.json")).tokenizer.vocab_size == 300
    assert dtmega_main(["generate", "--load-hf", str(bare), *GENERATE]) == 2
    assert "Fix: --tokenizer-model" in capsys.readouterr().err
    assert dtmega_main(["generate", "--load-hf", str(bare), "--tokenizer-model", str(whole / "tokenizer.json"),
                        *GENERATE]) == 0
