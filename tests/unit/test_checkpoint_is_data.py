"""A checkpoint is data: a payload planted in any file of a saved checkpoint never runs, and the
load is refused with the file named (issue 31, "Security").

The payload is a pickled call of `os.mkdir(marker)`: the marker directory exists afterwards if
and only if something unpickled it as code. Each case forges the manifest as well (a forger
rewrites checksums), and each shows first that torch's own reader *does* run the payload (so
the test would fail if dtmega read the file that way), then that dtmega refuses it unread.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from dtmega.checkpoint_reader import UnsafeCheckpointError, load_dcp, read_dcp_metadata
from dtmega.cli import main as dtmega_main
from dtmega.train.checkpoint import CheckpointError, select_checkpoint
from dtmega.train.checkpoint_manifest import MANIFEST, file_checksum
from dtmega.train.trainer import train
from tests.train_helpers import prepare_corpus, tiny_args


class Payload:
    """Pickles to `os.mkdir(marker)`: what a checkpoint from someone else could hold."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def payload_bytes(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"cpu": torch.get_rng_state(), "cuda": [], "lr": Payload(marker)}, buffer)
    return buffer.getvalue()


def forge_manifest(checkpoint: Path) -> None:
    """Rewrites manifest.json to match the files as they are now (what a forger does)."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name in list(manifest["files"]):
        if (checkpoint / name).is_file():
            size, crc = file_checksum(checkpoint / name)
            manifest["files"][name] = {"size": size, "crc32": crc}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=120)


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory) -> Path:
    """A --save directory of a clean 2-step run (iter_0000002)."""
    save = tmp_path_factory.mktemp("clean") / "ckpt"
    train(tiny_args(corpus, train_iters=2, save=str(save), eval_iters=1))
    return save


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved, target, symlinks=True)
    return target


def _plant_metadata(checkpoint: Path, marker: Path) -> str:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return ".metadata"


def _plant_bytes_entry(checkpoint: Path, marker: Path) -> str:
    """Re-saves the checkpoint's DCP part with one optimizer param-group value replaced by the
    payload, as torch writes any non-tensor value: a pickle inside the .distcp file."""
    metadata = read_dcp_metadata(checkpoint).state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata)
             else None for key, meta in metadata.items()}
    load_dcp(state, checkpoint, no_dist=True)
    victim = next(key for key, meta in metadata.items()
                  if isinstance(meta, BytesStorageMetadata) and key.startswith("optimizer.param_groups") and
                  key.endswith(".lr"))
    state[victim] = Payload(marker)
    for shard in checkpoint.glob("*.distcp"):
        shard.unlink()
    dcp.save(state, checkpoint_id=str(checkpoint), no_dist=True)
    return ".distcp"


def _plant_rng(checkpoint: Path, marker: Path) -> str:
    (checkpoint / "rng_rank00000.pt").write_bytes(payload_bytes(marker))
    return "rng_rank00000.pt"


def _plant_storage_path(checkpoint: Path, marker: Path) -> str:
    """`.metadata` rewritten so that a tensor's bytes are read from /dev/zero (a hang, before)."""
    metadata = read_dcp_metadata(checkpoint)
    for info in metadata.storage_data.values():
        info.relative_path = "/dev/zero"
        break
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return ".metadata"


def _plant_storage_path_up(checkpoint: Path, marker: Path) -> str:
    """docs/reliability.md, Checkpoints: `.metadata` naming `../..`: a tensor's bytes read from a
    copy of the shard two directories up (torch's reader would load it without a word)."""
    elsewhere = marker.parent / "elsewhere"
    elsewhere.mkdir()
    shard = next(checkpoint.glob("*.distcp"))
    shutil.copy(shard, elsewhere / shard.name)
    metadata = read_dcp_metadata(checkpoint)
    name = f"../../elsewhere/{shard.name}"
    assert (checkpoint / name).resolve() == (elsewhere / shard.name).resolve()
    for info in metadata.storage_data.values():
        info.relative_path = name
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return f".metadata: it names '{name}', which is not a file inside"


def _plant_storage_symlink(checkpoint: Path, marker: Path) -> str:
    """docs/reliability.md, Checkpoints: `.metadata` naming a symlink out of the checkpoint (a
    plain name inside it, linked to a copy of the shard elsewhere: torch's reader follows it)."""
    elsewhere = marker.parent / "elsewhere"
    elsewhere.mkdir()
    shard = next(checkpoint.glob("*.distcp"))
    shutil.copy(shard, elsewhere / shard.name)
    (checkpoint / "linked.distcp").symlink_to(elsewhere / shard.name)
    metadata = read_dcp_metadata(checkpoint)
    for info in metadata.storage_data.values():
        info.relative_path = "linked.distcp"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return f".metadata: it names {checkpoint / 'linked.distcp'}, which is a symlink"


PLANTS = {"metadata": _plant_metadata, "distcp_bytes_entry": _plant_bytes_entry, "rng": _plant_rng,
          "metadata_names_dev_zero": _plant_storage_path, "metadata_names_parent": _plant_storage_path_up,
          "metadata_names_symlink_out": _plant_storage_symlink}


PROOFS = {"metadata": lambda checkpoint: dcp.FileSystemReader(str(checkpoint)).read_metadata(),
          "distcp_bytes_entry": lambda checkpoint: dcp.load(
              {key: None for key in read_dcp_metadata(checkpoint).state_dict_metadata if ".param_groups." in key},
              checkpoint_id=str(checkpoint), no_dist=True),
          "rng": lambda checkpoint: torch.load(checkpoint / "rng_rank00000.pt", weights_only=False)}


@pytest.mark.parametrize("where", list(PROOFS))
def test_torch_s_own_readers_run_the_planted_payloads(copy, tmp_path, where):
    """Why the next test can fail: read the way torch reads by default, each payload runs."""
    marker = tmp_path / "payload-ran"
    PLANTS[where](copy / "iter_0000002", marker)
    with contextlib.suppress(Exception):  # the payload runs first; what torch does with its result may fail
        PROOFS[where](copy / "iter_0000002")
    assert marker.exists()


@pytest.mark.parametrize("where", list(PLANTS))
def test_a_planted_payload_never_runs_and_the_file_is_named(copy, corpus, tmp_path, where, capsys):
    """Resuming training, generating and exporting each refuse the forged checkpoint (exit 2,
    the file named, a fix given) and nothing in it runs. Generation and export read neither RNG
    states nor optimizer entries: they succeed there, and the payload still does not run."""
    iteration = copy / "iter_0000002"
    marker = tmp_path / "payload-ran"
    named = PLANTS[where](iteration, marker)
    forge_manifest(iteration)
    assert select_checkpoint(copy)[0] == iteration  # the forged manifest passes verification
    capsys.readouterr()
    reads_it = where not in ("rng", "distcp_bytes_entry")  # generation and export read no RNG, no optimizer
    for command in (["generate", "--load", str(copy), "--prompt", "a", "--max-new-tokens", "1"],
                    ["convert", "dtmega-to-hf", "--load", str(copy), "--hf-dir", str(tmp_path / "hf")]):
        assert dtmega_main(command) == (2 if reads_it else 0), command
        error = capsys.readouterr().err
        assert not reads_it or (named in error and "Fix:" in error), error
    with pytest.raises((UnsafeCheckpointError, CheckpointError), match=named.replace(".", r"\.")):
        train(tiny_args(corpus, train_iters=3, save=str(copy), load=str(copy), eval_iters=1))
    assert not marker.exists(), "a payload in the checkpoint ran"


def test_a_training_resume_refuses_a_payload_in_a_bytes_entry(copy, corpus, tmp_path):
    """The worst case of the matrix: a .distcp bytes entry ran on `train --load` and the run exited 0."""
    marker = tmp_path / "payload-ran"
    _plant_bytes_entry(copy / "iter_0000002", marker)
    forge_manifest(copy / "iter_0000002")
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0\.distcp: its entry 'optimizer\.param_groups\..*\.lr' is "
                                                    r"not plain data"):
        train(tiny_args(corpus, train_iters=3, save=str(copy), load=str(copy), eval_iters=1))
    assert not marker.exists()


def test_latest_never_leads_out_of_the_directory(copy, saved, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(saved, other)
    (copy / "latest").write_text("../other/iter_0000002")
    with pytest.raises(CheckpointError, match=r"latest names '\.\./other/iter_0000002', which leads out of"):
        select_checkpoint(copy)
    (copy / "latest").write_text("iter_0000009")
    (copy / "iter_0000009").symlink_to(other / "iter_0000002")
    with pytest.raises(CheckpointError, match=r"latest names 'iter_0000009', which leads out of"):
        select_checkpoint(copy)


@pytest.mark.parametrize("content, said", [(b"", "is empty"), (b"\xff\xfe\x00", "not text"),
                                           (b"garbage", "not an iter_\\* name")])
def test_a_damaged_latest_is_named_and_the_newest_intact_checkpoint_loads(copy, content, said):
    (copy / "latest").write_bytes(content)
    checkpoint, notes = select_checkpoint(copy)
    assert checkpoint.name == "iter_0000002"
    assert any("latest" in note and __import__("re").search(said, note) for note in notes), notes


@pytest.mark.parametrize("entry", ["/dev/zero", "../../etc/passwd", "zero_link"])
def test_a_manifest_entry_outside_the_checkpoint_is_refused_unread(copy, entry):
    iteration = copy / "iter_0000002"
    (iteration / "zero_link").symlink_to("/dev/zero")
    manifest = json.loads((iteration / MANIFEST).read_text())
    manifest["files"][entry] = {"size": 0, "crc32": "00000000"}
    (iteration / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refused unread"):
        select_checkpoint(iteration)


def test_hugging_face_checkpoints_are_read_from_safetensors_only(tmp_path, capsys):
    from tests.hf_models import save_tiny_llama31

    hf = save_tiny_llama31(tmp_path / "hf")
    marker = tmp_path / "payload-ran"
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt"):
        (hf / name).write_bytes(payload_bytes(marker))
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(tmp_path / "ckpt")]) == 0
    assert not marker.exists()
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "../../elsewhere.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(tmp_path / "ckpt2")]) == 2
    assert "names shards outside" in capsys.readouterr().err
    for file in hf.glob("model*.safetensors*"):
        file.unlink()
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(tmp_path / "ckpt3")]) == 2
    assert "save the model with safetensors" in capsys.readouterr().err
    assert not marker.exists()


def test_a_hugging_face_config_that_disagrees_with_its_weights_is_refused_with_the_names(tmp_path, capsys):
    """config.json says 1 layer, the shards hold 2: before, a 1-layer model was built and layer
    1's tensors ignored without a word."""
    from tests.hf_models import save_tiny_llama31

    hf = save_tiny_llama31(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (hf / "config.json").write_text(json.dumps(config))
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(tmp_path / "ckpt")]) == 2
    error = capsys.readouterr().err
    assert "the shards hold 9 tensors the model config.json describes does not use: model.layers.1." in error, error
    assert "num_hidden_layers" in error and not (tmp_path / "ckpt").exists()


def test_a_hugging_face_config_with_fewer_experts_than_its_weights_names_the_unused_experts(tmp_path, capsys):
    """docs/reliability.md, Runs: a `config.json` with fewer "experts than its weights": the
    unused tensors are named. Mixtral's config says 3 experts, the shards hold 4: expert 3's
    three matrices in each of the 2 layers are named (before, the routers' shapes were reported,
    [4, 64] against [3, 64], and the experts left unsaid), and nothing is written."""
    from tests.hf_models import save_tiny_mixtral

    hf = save_tiny_mixtral(tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["num_local_experts"] = 3
    (hf / "config.json").write_text(json.dumps(config))
    assert dtmega_main(["convert", "hf-to-dtmega", "--hf-dir", str(hf), "--save", str(tmp_path / "ckpt")]) == 2
    error = capsys.readouterr().err
    assert ("the shards hold 6 tensors the model config.json describes does not use: "
            "model.layers.0.block_sparse_moe.experts.3.w1.weight, model.layers.0.block_sparse_moe.experts.3.w2.weight, "
            "model.layers.0.block_sparse_moe.experts.3.w3.weight, model.layers.1.block_sparse_moe.experts.3.w1.weight"
            ) in error, error
    assert "num_local_experts" in error and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("target", ["an_intact_copy_elsewhere", "nothing"], ids=["N8_symlink_to_a_copy", "N7_dangling"])
def test_a_shard_that_is_a_symlink_is_refused_unread(copy, tmp_path, target, capsys):
    """Matrix-2 N7/N8: a checkpoint's files are its own; a shard linked from elsewhere (or to
    nothing) is named, and with no other checkpoint there `generate --load` stops in one line."""
    shard = copy / "iter_0000002" / "__0_0.distcp"
    elsewhere = tmp_path / "elsewhere.distcp"
    if target == "an_intact_copy_elsewhere":
        shutil.copy(shard, elsewhere)
    shard.unlink()
    shard.symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is a symlink or not a regular file \(refused unread"):
        select_checkpoint(copy)
    capsys.readouterr()
    assert dtmega_main(["generate", "--load", str(copy), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert "is a symlink or not a regular file" in capsys.readouterr().err
