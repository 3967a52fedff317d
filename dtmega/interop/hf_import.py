"""A Hugging Face model directory as a dtmega checkpoint (`dtmega convert hf-to-dtmega`), and the
checkpoint state an HF model stands for when commands load it directly (`--load-hf`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from dtmega.interop.hf_checkpoint import HFCheckpoint

# The sequence length commands default to for an HF model (its `args.seq_length`): its context,
# capped so that `dtmega evaluate` of a 128K-context model does not default to 128K windows.
DEFAULT_SEQ_LENGTH = 2048


def hf_state(checkpoint: HFCheckpoint) -> dict:
    """The state.json an HF model stands for: iteration 0, the dtmega model of its architecture
    with the HF config, the tokenizer's end-of-document token, and the source's small files kept
    for export."""
    from dtmega.models import model_spec

    tokenizer = checkpoint.tokenizer
    config_dict = model_spec(checkpoint.model).config_to_dict(checkpoint.config)
    return {
        "iteration": 0, "consumed_samples": 0, "model": checkpoint.model, "model_config": config_dict,
        "args": {"seq_length": min(checkpoint.config.max_seq_len, DEFAULT_SEQ_LENGTH)},
        # none: converted from a directory without tokenizer files (commands then take --tokenizer-model)
        "tokenizer": {} if tokenizer is None else {
            "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(checkpoint.path),
            "eod_token": getattr(tokenizer, "eod_token", None)},
        "hf_files": checkpoint.kept, "source": {"hf_dir": str(checkpoint.path.resolve())},
    }


# The token ids of config.json: they name tokens of the source's tokenizer.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def files_kept_by_a_run(kept: dict[str, str], same_tokenizer: bool) -> dict[str, str]:
    """What a run started from a Hugging Face model keeps of its small files for a later export
    (`--save-hf`, `convert dtmega-to-hf`): all of them when the run uses the model's own tokenizer,
    so that the fine-tune exports with the source's token ids, generation settings, special
    tokens and chat template; with another tokenizer, only config.json without its token ids
    (they would name the source's tokens; the export takes the run's end-of-document token)."""
    if same_tokenizer or "config.json" not in kept:
        return dict(kept) if same_tokenizer else {}
    config = {key: value for key, value in json.loads(kept["config.json"]).items() if key not in TOKEN_ID_KEYS}
    return {"config.json": json.dumps(config, indent=2) + "\n"}


def import_hf(hf_dir: str | Path, save: str | Path, *, tokenizer_model: str | None = None,
              on_phase: Callable[[str], None] | None = None, allow_older: bool = False) -> Path:
    """Writes the HF model `hf_dir` as a dtmega checkpoint `save/iter_0000000` (weights,
    tokenizer, config; no optimizer state) and returns its path. One process holds the whole
    model; under torchrun the ranks shard it (FSDP over the world) and each writes its part.
    A directory without tokenizer files converts too (weights need none): the checkpoint then has
    no tokenizer.json, and a note says that generate, serve and evaluate will need --tokenizer-model."""
    import dtmega
    from dtmega.mesh import default_device_type
    from dtmega.passes import DataParallel, Plan
    from dtmega.train.checkpoint import save_checkpoint
    from dtmega.train.save_ownership import new_run_id

    on_phase = on_phase or (lambda name: None)
    on_phase("checking the Hugging Face files")
    checkpoint = HFCheckpoint.open(hf_dir, tokenizer_model, weights_only=True, flag="--hf-dir")
    if checkpoint.notes and (not dist.is_initialized() or dist.get_rank() == 0):
        from dtmega.printing import console

        for note in checkpoint.notes:
            console().print(f"[dim]note: {note}[/dim]", highlight=False)
    on_phase("building the model")
    import torch

    with torch.device("meta"):
        model = checkpoint.architecture.build(checkpoint.config)
    mesh = dtmega.make_mesh(dp_shard=-1, device_type=default_device_type())  # every rank of the launch
    world = dist.get_world_size()
    pm = dtmega.parallelize(model, mesh, Plan([DataParallel("fsdp")] if world > 1 else []))
    pm.materialize()  # allocated, not initialized: every weight is read next
    on_phase("reading the weights")
    checkpoint.load_into(pm.module)
    on_phase("writing the checkpoint")
    state = {**hf_state(checkpoint), "world_size": world, "run_id": new_run_id()}
    tokenizer_json = None if checkpoint.tokenizer is None else checkpoint.tokenizer.to_json()
    return save_checkpoint(save, 0, pm.module, None, state, tokenizer_json=tokenizer_json, allow_older=allow_older)
