"""Rebuild a trained model from a checkpoint alone (config, tokenizer and weights)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

import dtmega
from dtmega.data.tokenizers import Tokenizer, tokenizer_from_json, tokenizer_from_path
from dtmega.kernels.errors import DtmegaError, MissingInput
from dtmega.mesh import default_device_type
from dtmega.models import model_spec
from dtmega.models.registry import ModelSpec
from dtmega.passes import DataParallel, DocumentMasking, Plan, TensorParallel
from dtmega.train.checkpoint import (
    TOKENIZER,
    load_checkpoint,
    read_state,
    select_checkpoint,
)
from dtmega.train.checkpoint_manifest import LOCAL


@dataclass
class CheckpointHead:
    """What a checkpoint says about itself without loading a weight: enough to check a request
    against the model (its context length, its tokenizer) before any allocation."""

    checkpoint: Path
    state: dict
    spec: ModelSpec
    config: Any
    tokenizer: Tokenizer


def read_head(load: str | Path, custom_import: tuple = (), contents: bool = True, group=None,
              tokenizer_model: str | None = None) -> CheckpointHead:
    """The checkpoint's state, model spec and config, and tokenizer (files only). The checkpoint
    is verified against its manifest (`contents=False`: sizes only, no checksums); a damaged
    `latest` of a --save directory falls back to the newest intact one, said on stderr. `group`:
    the ranks that share the checksum work (default: the world, when a process group is up).
    `tokenizer_model` (--tokenizer-model) replaces the checkpoint's tokenizer.json: what a
    checkpoint converted from a Hugging Face directory without tokenizer files needs."""
    checkpoint, notes = select_checkpoint(load, contents, group)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    state = read_state(checkpoint)
    for module in custom_import:
        importlib.import_module(module)
    name = state.get("model", "llama")  # checkpoints from before model specs hold dtmega Llamas
    try:
        spec = model_spec(name)
    except KeyError as error:
        raise DtmegaError(f"{checkpoint} holds a {name!r} model: {error.args[0]}") from None
    config = spec.config_from_dict(state["model_config"])
    tokenizer_file = checkpoint / TOKENIZER
    if tokenizer_model is not None:
        tokenizer = tokenizer_from_path(tokenizer_model)
    elif not tokenizer_file.exists():
        raise MissingInput(f"{checkpoint} has no {TOKENIZER} (converted from a Hugging Face directory without tokenizer "
                           "files, or not written by dtmega). Fix: --tokenizer-model with the model's tokenizer.json, "
                           "tokenizer.model or tokenizer directory")
    else:
        tokenizer = tokenizer_from_json(tokenizer_file.read_text(), state.get("tokenizer", {}).get("eod_token"))
    if tokenizer.vocab_size > config.vocab_size:
        which = f"--tokenizer-model {tokenizer_model}" if tokenizer_model is not None else "the checkpoint's tokenizer"
        raise DtmegaError(
            f"{which} has {tokenizer.vocab_size} tokens but the checkpoint's model only {config.vocab_size}. "
            "Fix: the tokenizer the model was trained with"
        )
    return CheckpointHead(checkpoint, state, spec, config, tokenizer)


def read_hf_head(load_hf: str | Path, tokenizer_model: str | None = None) -> CheckpointHead:
    """The head of a Hugging Face model directory (config, tokenizer, every shard's header
    checked; no weight read): what `--load-hf` commands check a request against.
    `tokenizer_model` replaces the directory's tokenizer files."""
    from dtmega.interop.hf_checkpoint import HFCheckpoint

    return hf_head(HFCheckpoint.open(load_hf, tokenizer_model))


def hf_head(checkpoint) -> CheckpointHead:
    """The CheckpointHead an opened HFCheckpoint stands for (the dtmega model of its
    architecture, iteration 0)."""
    from dtmega.interop.hf_import import hf_state

    return CheckpointHead(checkpoint.path, hf_state(checkpoint), model_spec(checkpoint.model), checkpoint.config,
                          checkpoint.tokenizer)


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """`--load CKPT` or `--load-hf DIR` (exactly one), for the commands that run a trained model."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--load", help="checkpoint (a --save directory or an iter_* directory)")
    group.add_argument("--load-hf", help="a Hugging Face model directory (config.json, *.safetensors, tokenizer), "
                                         "read shard by shard without a conversion step")
    parser.add_argument("--tokenizer-model", help="the tokenizer (tokenizer.json, tokenizer.model or a directory) "
                                                  "instead of the checkpoint's: for one converted without tokenizer "
                                                  "files (default: the checkpoint's own)")


def read_source_head(args: argparse.Namespace, contents: bool = True) -> CheckpointHead:
    """The head of `--load` or `--load-hf`, whichever `args` has."""
    tokenizer_model = getattr(args, "tokenizer_model", None)
    if getattr(args, "load_hf", None):
        return read_hf_head(args.load_hf, tokenizer_model)
    return read_head(args.load, tuple(getattr(args, "custom_import", ())), contents=contents,
                     tokenizer_model=tokenizer_model)


RESTORE_PHASES = 3


def restore(
    load: str | Path | None, *, tp: int = 1, data_parallel: str | None = None, mesh=None, custom_import: tuple = (),
    on_phase: Callable[[str], None] | None = None, load_hf: str | Path | None = None, document_masking: bool = False,
    tokenizer_model: str | None = None, positions: int | None = None,
) -> tuple[dtmega.ParallelModel, Tokenizer, dict]:
    """(model sharded TP-ways [x data-parallel over the remaining ranks: "ddp" or "fsdp"], its
    tokenizer, its saved state). `load_hf` instead of `load`: a Hugging Face model directory,
    each rank reading only its slices. `mesh` overrides the mesh built from the world (e.g. a
    sub-mesh of a larger job); `custom_import` names modules that register the model;
    `on_phase(name)` is told each of the RESTORE_PHASES phases as it starts (a progress bar's
    `phase`); `document_masking`: the plan masks attention per document, as `train --sft` and
    --reset-attention-mask train (batches then carry their document ids: packed chat samples);
    `tokenizer_model` (--tokenizer-model) replaces the checkpoint's tokenizer; `positions` (serve's
    --max-model-len, generate's prompt + new tokens) builds the RoPE table for that many positions
    only, not the config's whole context (matrix 3, F6: 2 GB for a 10^7-position config serving
    256); a family whose positions are weights (learned absolute positions) keeps its own."""
    on_phase = on_phase or (lambda name: None)
    on_phase("checking the checkpoint's files")
    if mesh is None:
        device_type = default_device_type()
        if data_parallel == "ddp":
            mesh = dtmega.make_mesh(tp=tp, dp_replicate=-1, dp_shard=1, device_type=device_type)
        else:
            mesh = dtmega.make_mesh(tp=tp, dp_shard=-1 if data_parallel else 1, device_type=device_type)
    whole_world = dist.is_initialized() and mesh.size() == dist.get_world_size()
    hf = None
    if load_hf is not None:
        from dtmega.interop.hf_checkpoint import HFCheckpoint

        hf = HFCheckpoint.open(load_hf, tokenizer_model)
        head = hf_head(hf)
    else:  # the mesh's ranks share the checksum work
        head = read_head(load, custom_import, group=None if whole_world else LOCAL, tokenizer_model=tokenizer_model)
    checkpoint, state, spec, config, tokenizer = head.checkpoint, head.state, head.spec, head.config, head.tokenizer
    if positions is not None and 0 < positions < getattr(config, "max_seq_len", 0) \
            and getattr(config, "position_embedding", "rope") != "learned_absolute":
        config = dataclasses.replace(config, max_seq_len=positions)  # a RoPE table is no weight: nothing else changes
    on_phase("building the model")
    passes = [TensorParallel()] if tp > 1 else []
    if document_masking:  # where the training plan has it: after the model's split, before data parallelism
        passes.append(DocumentMasking())
    if data_parallel:
        passes.append(DataParallel(data_parallel))
    model = spec.instantiate(config, seed=0)
    if spec.materialize == "seeded" and mesh.device_type != "cpu":
        model.to(mesh.device_type)
    pm = dtmega.parallelize(model, mesh, Plan(passes))
    if spec.materialize == "meta":
        pm.materialize()  # allocates and builds buffers; the weights are read next
    on_phase("reading the weights")
    if hf is not None:
        hf.load_into(pm.module)
    else:
        load_checkpoint(checkpoint, pm.module, restore_rng=False)
    return pm, tokenizer, state


def restore_with_progress(load: str | Path | None, **kwargs) -> tuple[dtmega.ParallelModel, Tokenizer, dict]:
    """`restore` under a progress display of its phases (commands that load a checkpoint: a big
    one takes a while to check and read, and the user sees which phase it is in)."""
    from dtmega.progress import progress_bar

    with progress_bar(f"loading {load or kwargs.get('load_hf')}", total=RESTORE_PHASES, unit="phases",
                      phased=True) as bar:
        return restore(load, on_phase=bar.phase, **kwargs)
