"""A dtmega checkpoint as a Hugging Face model directory, streamed shard by shard.

The output holds `model-0000k-of-0000n.safetensors` shards of at most `max_shard_bytes` each,
`model.safetensors.index.json`, `config.json`, `generation_config.json` and the tokenizer
(`tokenizer.json` or a SentencePiece `tokenizer.model`, with `tokenizer_config.json`; none for a
checkpoint converted from a directory without tokenizer files), and
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads it unchanged. Only one shard's
tensors are in memory at a time: each is read from the DCP checkpoint by name
(`dcp.load` of those keys, resharded from however it was saved), laid out as HF wants
(the architecture's name map, hf_architectures.py), cast to the output dtype and written. Everything goes to `OUT.partial` first,
renamed to OUT at the end: a failed export leaves no half-written model behind, and an OUT
that exists is refused rather than overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from dtmega.checkpoint_reader import load_dcp, read_dcp_metadata
from dtmega.data.tiktoken_tokenizer import TikTokenizer
from dtmega.data.tokenizers import (
    BPE_EOD,
    ByteTokenizer,
    SentencePieceTokenizer,
    tokenizer_from_json,
)
from dtmega.interop.hf_architectures import architecture_of_family
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.llama.hf_names import HFPart
from dtmega.train.checkpoint import TOKENIZER, read_state, resolve_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30


def _model_sizes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """dtmega tensor name -> shape, from the DCP metadata (the model's keys only)."""
    metadata = read_dcp_metadata(checkpoint).state_dict_metadata
    return {key.removeprefix("model."): tuple(meta.size) for key, meta in metadata.items()
            if key.startswith("model.") and hasattr(meta, "size")}


def _shards(sizes: dict[str, tuple[int, ...]], element: int, limit: int) -> list[list[str]]:
    """Names grouped into shards of at most `limit` bytes (a bigger tensor gets its own), in the
    model's order."""
    groups, current, used = [], [], 0
    for name, shape in sizes.items():
        nbytes = element * int(torch.Size(shape).numel())
        if current and used + nbytes > limit:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    return groups + ([current] if current else [])


def export_hf(load: str | Path, out: str | Path, *, dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              on_shard: Callable[[int, int], None] | None = None) -> Path:
    """Writes the dtmega checkpoint `load` (a --save directory or an iter_* directory) as a
    Hugging Face model directory `out`; returns `out`. `dtype`: float32, bfloat16 or float16
    (default: the dtype of the model it came from, else float32). `on_shard(done, total)` is
    told each finished shard (a progress bar). Runs in one process."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HFFormatError(f"--hf-dir {out} exists and is not empty; nothing was written. Fix: a new directory, "
                            "or remove that one first")
    checkpoint = resolve_checkpoint(load)
    state = read_state(checkpoint)
    from dtmega.models import model_spec

    spec = model_spec(state.get("model", "llama"))
    architecture = architecture_of_family(spec.family, f"{checkpoint} ({spec.name!r})")
    config = spec.config_from_dict(state["model_config"])
    kept = state.get("hf_files", {})
    base = json.loads(kept["config.json"]) if "config.json" in kept else None
    dtype = dtype or (base or {}).get("dtype") or (base or {}).get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise HFFormatError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    # the weights written are dequantized: the source's quantization (and its config.json text) no longer apply
    quantized = base is not None and base.pop("quantization_config", None) is not None
    hf_config = architecture.hf_config(config, base, dtype)  # refuses a model the architecture cannot express, first
    tokenizer = None  # none: converted from a Hugging Face directory without tokenizer files, exported without them
    if (checkpoint / TOKENIZER).exists():
        tokenizer = tokenizer_from_json((checkpoint / TOKENIZER).read_text(), state.get("tokenizer", {}).get("eod_token"))
    sizes = _model_sizes(checkpoint)
    if config.tie_embeddings:
        sizes.pop("output.weight", None)
    groups = _shards(sizes, torch.tensor([], dtype=DTYPES[dtype]).element_size(), max_shard_bytes)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map, total = {}, 0
    parts: dict[str, dict[int, HFPart]] = {}
    for number, names in enumerate(groups, start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        full = {"model": {name: torch.empty(sizes[name], dtype=torch.float32) for name in names}}
        with warnings.catch_warnings():  # one process on purpose: DCP's "assuming single process" note
            warnings.simplefilter("ignore", UserWarning)
            load_dcp(full, checkpoint, no_dist=True)
        tensors = {}
        for name in names:
            for hf_name, tensor in architecture.tensors(name, full["model"][name], config).items():
                if isinstance(tensor, HFPart):  # a piece of a fused HF tensor: written once all are read
                    pieces = parts.setdefault(hf_name, {})
                    pieces[tensor.index] = tensor
                    if len(pieces) < tensor.count:
                        continue
                    tensor = torch.cat([pieces[i].tensor for i in range(tensor.count)], dim=tensor.dim)
                    del parts[hf_name]
                tensors[hf_name] = tensor.to(DTYPES[dtype]).contiguous()
        del full
        save_file(tensors, str(partial / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({hf_name: file for hf_name in tensors})
        del tensors
        if on_shard:
            on_shard(number, len(groups))
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    if tokenizer is not None:
        _write_tokenizer(partial, tokenizer, kept, config)
        hf_config.setdefault("eos_token_id", tokenizer.eod)
    (partial / "config.json").write_text(kept["config.json"] if base == hf_config and not quantized and "config.json" in kept
                                         else json.dumps(hf_config, indent=2) + "\n")
    eos = {"eos_token_id": tokenizer.eod} if tokenizer is not None else {}
    generation = kept.get("generation_config.json") or json.dumps(
        {**eos, "transformers_version": hf_config.get("transformers_version", "5.0.0")}, indent=2) + "\n"
    (partial / "generation_config.json").write_text(generation)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(partial, out)
    return out


def _write_tokenizer(directory: Path, tokenizer, kept: dict[str, str], config) -> None:
    """tokenizer.json (or tokenizer.model) and the settings files transformers' AutoTokenizer
    reads; the source model's own settings when the checkpoint kept them."""
    if isinstance(tokenizer, ByteTokenizer):  # as a byte-level BPE without merges: the same ids
        (directory / "tokenizer.json").write_text(tokenizer.as_huggingface().to_str())
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BPE_EOD, "pad_token": "<|pad|>"}
    elif isinstance(tokenizer, TikTokenizer):  # the same ids as a byte-level BPE with the merges its ranks imply
        (directory / "tokenizer.json").write_text(tokenizer.as_huggingface().to_str())
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eod_token,
                    "bos_token": "<s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    elif isinstance(tokenizer, SentencePieceTokenizer):
        (directory / "tokenizer.model").write_bytes(tokenizer.proto)
        settings = {"tokenizer_class": "LlamaTokenizer", "eos_token": tokenizer.eod_token}
    else:
        (directory / "tokenizer.json").write_text(tokenizer.to_json())
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eod_token}
    settings["model_max_length"] = config.max_seq_len
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if name in kept:
            (directory / name).write_text(kept[name])
    if "tokenizer_config.json" not in kept:
        (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
