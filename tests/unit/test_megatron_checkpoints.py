"""Megatron-Core checkpoints into dtmega: a GPTModel saved by megatron-core's own
dist_checkpointing (torch_dist, written by two tensor-parallel ranks on CPU:
tests/megatron_core_gpt.py) converts with logits equal to that model's forward.

Tolerance: 1e-5 relative (max |difference| / max |logit|, fp32): the same weights, two
implementations' reduction orders (~3e-7 measured).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dtmega.cli import main as dtmega_main
from dtmega.interop.megatron_core import MegatronFormatError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "tests" / "megatron_core_gpt.py"),
                           str(out)], check=False, capture_output=True, text=True, cwd=ROOT, env={**os.environ,
                               "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


FLAGS = ["--num-attention-heads", "4", "--num-query-groups", "2", "--tokenizer-type", "byte",
         "--max-position-embeddings", "64"]


def test_megatron_core_checkpoint_converts_with_logits_parity(megatron_checkpoint, tmp_path):
    from dtmega.train.restore import restore

    assert dtmega_main(["convert", "megatron-to-dtmega", "--load", str(megatron_checkpoint / "iter_0000001"),
                        "--save", str(tmp_path / "ckpt"), *FLAGS]) == 0
    reference = torch.load(megatron_checkpoint / "logits.pt")
    pm, _, state = restore(tmp_path / "ckpt")
    assert state["source"]["megatron_core"].endswith("iter_0000001")
    with torch.no_grad():
        ours = pm.module(reference["tokens"])
    error = float((ours - reference["logits"]).abs().max() / reference["logits"].abs().max())
    assert error < 1e-5, error


@pytest.mark.parametrize("flags, message", [
    (["--num-attention-heads", "4", "--num-query-groups", "4"], "linear_qkv.weight has 128 rows, but"),
    (["--num-attention-heads", "3"], "do not divide the hidden size 64"),
])
def test_flags_that_disagree_with_the_shapes_are_refused(megatron_checkpoint, tmp_path, flags, message):
    from dtmega.interop.convert_cli import build_parser
    from dtmega.interop.megatron_cli import convert_megatron

    args = build_parser().parse_args(["megatron-to-dtmega", "--load", str(megatron_checkpoint / "iter_0000001"),
                                      "--save", str(tmp_path / "c"), "--tokenizer-type", "byte", *flags])

    with pytest.raises(MegatronFormatError, match=message):
        convert_megatron(args)
    assert not (tmp_path / "c").exists()


def test_a_directory_that_is_not_torch_dist_is_refused(tmp_path):
    from dtmega.interop.megatron_core import MegatronCheckpoint

    with pytest.raises(MegatronFormatError, match="has no .metadata: not a Megatron-Core torch_dist checkpoint"):
        MegatronCheckpoint(tmp_path)


def test_a_megatron_checkpoint_is_read_as_data(megatron_checkpoint, tmp_path, capsys):
    """A payload in its `.metadata` is refused with the file named, unrun; one in `common.pt`
    (megatron-core's pickled run arguments, which dtmega never needs) is never read."""
    import pickle
    import shutil

    from tests.unit.test_checkpoint_is_data import Payload, payload_bytes

    copy = tmp_path / "iter_0000001"
    shutil.copytree(megatron_checkpoint / "iter_0000001", copy)
    marker = tmp_path / "payload-ran"
    (copy / "common.pt").write_bytes(payload_bytes(marker))
    argv = ["convert", "megatron-to-dtmega", "--load", str(copy), *FLAGS]
    assert dtmega_main([*argv, "--save", str(tmp_path / "a")]) == 0
    (copy / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    capsys.readouterr()
    assert dtmega_main([*argv, "--save", str(tmp_path / "b")]) == 2
    error = capsys.readouterr().err
    assert f"{copy / '.metadata'}: its pickle asks for posix.mkdir" in error and "Fix:" in error, error
    assert not marker.exists() and not (tmp_path / "b").exists()


def _megatron_core_checkpoint(out: Path, *flags: str) -> Path:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "tests" / "megatron_core_gpt.py"),
                           str(out), *flags], check=False, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def megatron_gpt_checkpoint(tmp_path_factory) -> Path:
    """megatron-core's own GPT blocks (LayerNorm, biases, GeLU, learned positions, tied), TP2."""
    return _megatron_core_checkpoint(tmp_path_factory.mktemp("megatron_gpt"), "--gpt-blocks")


def test_megatron_core_gpt_blocks_convert_with_logits_parity(megatron_gpt_checkpoint, tmp_path):
    """Issue 51 item 1: a checkpoint of Megatron's GPT blocks becomes a dtmega GPT with megatron-core's
    logits (1e-5: fp32 sums in another order); the GeLU's form is a flag of the run (F.gelu here,
    --no-bias-gelu-fusion), and the fused bias-GeLU's tanh form gives other logits (the test can fail)."""
    from dtmega.train.restore import restore

    reference = torch.load(megatron_gpt_checkpoint / "logits.pt")
    errors = {}
    for form, extra in (("erf", ["--no-bias-gelu-fusion"]), ("tanh", [])):
        assert dtmega_main(["convert", "megatron-to-dtmega", "--load", str(megatron_gpt_checkpoint / "iter_0000001"),
                            "--save", str(tmp_path / form), *FLAGS, *extra]) == 0
        pm, _, state = restore(tmp_path / form)
        assert state["model"] == "gpt" and type(pm.module).__name__ == "GPT"
        config = pm.module.config
        assert (config.normalization, config.position_embedding, config.bias, config.tie_embeddings) == \
            ("LayerNorm", "learned_absolute", True, True)
        pm.module.eval()
        with torch.no_grad():
            ours = pm.module(reference["tokens"])
        errors[form] = float((ours - reference["logits"]).abs().max() / reference["logits"].abs().max())
    assert errors["erf"] < 1e-5 and errors["tanh"] > 1e-4, errors


@pytest.fixture(scope="module")
def megatron_gpt_qk_checkpoint(tmp_path_factory) -> Path:
    """GPT blocks with --qk-layernorm and RoPE, written by megatron-core, TP2."""
    return _megatron_core_checkpoint(tmp_path_factory.mktemp("megatron_gpt_qk"), "--gpt-blocks", "--qk-layernorm")


def test_megatron_core_partial_rotary_converts_with_logits_parity(tmp_path):
    """--rotary-percent 0.5 (RoPE on each head's first 8 of 16 channels, the frequencies of an
    8-wide head): megatron-core's logits (1e-5); converted as full rotary, other logits."""
    from dtmega.train.restore import restore

    source = _megatron_core_checkpoint(tmp_path / "megatron", "--gpt-blocks", "--qk-layernorm", "--rotary-percent", "0.5")
    reference = torch.load(source / "logits.pt")
    errors = {}
    for name, extra in (("half", ["--rotary-percent", "0.5"]), ("full", [])):
        assert dtmega_main(["convert", "megatron-to-dtmega", "--load", str(source / "iter_0000001"),
                            "--save", str(tmp_path / name), *FLAGS, "--no-bias-gelu-fusion", *extra]) == 0
        pm, _, _ = restore(tmp_path / name)
        pm.module.eval()
        with torch.no_grad():
            ours = pm.module(reference["tokens"])
        errors[name] = float((ours - reference["logits"]).abs().max() / reference["logits"].abs().max())
    assert errors["half"] < 1e-5 and errors["full"] > 1e-4, errors


def test_megatron_core_gpt_blocks_with_qk_layernorm_convert_with_logits_parity(megatron_gpt_qk_checkpoint, tmp_path):
    """--qk-layernorm on GPT blocks with RoPE: each head's LayerNorm (weight and bias) is read and
    put in dtmega's channel order; logits equal megatron-core's (1e-5). Converting with
    --rotary-interleaved (no reordering) gives other logits, so the reordering is held too."""
    from dtmega.train.restore import restore

    source = megatron_gpt_qk_checkpoint
    reference = torch.load(source / "logits.pt")
    errors = {}
    for name, extra in (("halves", []), ("interleaved", ["--rotary-interleaved"])):
        assert dtmega_main(["convert", "megatron-to-dtmega", "--load", str(source / "iter_0000001"),
                            "--save", str(tmp_path / name), *FLAGS, "--no-bias-gelu-fusion", *extra]) == 0
        pm, _, _ = restore(tmp_path / name)
        assert pm.module.config.qk_norm and pm.module.config.position_embedding == "rope"
        pm.module.eval()
        with torch.no_grad():
            ours = pm.module(reference["tokens"])
        errors[name] = float((ours - reference["logits"]).abs().max() / reference["logits"].abs().max())
    assert errors["halves"] < 1e-5 and errors["interleaved"] > 1e-4, errors


def test_weights_a_conversion_would_drop_are_refused_by_name(megatron_gpt_qk_checkpoint, tmp_path, monkeypatch, capsys):
    """A converter that does not know a feature of the run (here: one that reads the GPT blocks
    without their q/k norms, as this one did before --qk-layernorm was read) refuses, naming the
    weights it would drop, and writes nothing, instead of saving another model."""
    import dataclasses

    import dtmega.interop.megatron_cli as cli

    real = cli.gpt_config_from_megatron
    monkeypatch.setattr(cli, "gpt_config_from_megatron",
                        lambda *args: dataclasses.replace(real(*args), qk_norm=False))
    code = dtmega_main(["convert", "megatron-to-dtmega", "--load", str(megatron_gpt_qk_checkpoint / "iter_0000001"),
                        "--save", str(tmp_path / "out"), *FLAGS, "--no-bias-gelu-fusion"])
    error = capsys.readouterr().err
    assert code != 0 and "holds weights the dtmega gpt model would not read" in error, error
    assert "self_attention.q_layernorm.weight" in error and "Fix:" in error
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
