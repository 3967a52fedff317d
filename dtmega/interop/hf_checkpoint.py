"""A Hugging Face checkpoint directory, opened and checked before any weight is read, and loaded
into a dtmega model sharded by any plan.

`HFCheckpoint.open(dir)` reads `config.json` (mapped to a LlamaConfig, hf_config.py), the
safetensors index (`model.safetensors.index.json`, or one `model.safetensors`), every shard's
header (names, shapes, dtypes: a few KiB each) and the tokenizer, and checks them against each
other: a shard the index names but the directory lacks, a tensor the model needs but no shard
holds, a shape that disagrees with the config, a tokenizer larger than the embedding. Each is an
HFFormatError naming the file and the fix, raised on every rank alike before any allocation.
`load_into(module)` then fills the module's (sharded) tensors through DCP (hf_reader.py).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from dtmega.checkpoint_reader import DataOnlyLoadPlanner, is_file_name
from dtmega.data.tokenizers import Tokenizer, tokenizer_from_path
from dtmega.interop.hf_reader import HFSafetensorsReader
from dtmega.models.llama import Llama
from dtmega.models.llama.config import LlamaConfig
from dtmega.models.llama.hf_config import HFFormatError, llama_config_from_hf
from dtmega.models.llama.hf_names import WeightSource, hf_source

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Small text files of an HF model directory that a dtmega checkpoint keeps, so that exporting
# it again writes the same config, generation settings, tokenizer settings and chat template.
KEPT_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def model_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every dtmega tensor's global shape for `config`, from the model built on the meta device
    (no arithmetic of our own to disagree with the model)."""
    with torch.device("meta"):
        model = Llama(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@dataclass
class HFCheckpoint:
    """A checked Hugging Face model directory: its config, tokenizer and tensor index."""

    path: Path
    hf_config: dict
    config: LlamaConfig
    tokenizer: Tokenizer
    files: dict[str, Path]  # HF tensor name -> its safetensors file
    shapes: dict[str, tuple[int, ...]]  # HF tensor name -> shape
    dtypes: dict[str, torch.dtype]
    kept: dict[str, str] = field(default_factory=dict)  # KEPT_FILES present, as text

    @classmethod
    def open(cls, path: str | Path, tokenizer_model: str | None = None,
             tokenizer: Tokenizer | None = None) -> HFCheckpoint:
        """Opens and checks `path` (see the module docstring); `tokenizer_model` (a path) or
        `tokenizer` (built already, e.g. from a run's --tokenizer-type) overrides the directory's
        own tokenizer files."""
        path = Path(path)
        if not path.is_dir():
            raise HFFormatError(f"--load-hf {path}: no such directory. Fix: a Hugging Face model directory "
                                "(config.json, *.safetensors, tokenizer.json)")
        config_file = path / "config.json"
        if not config_file.exists():
            raise HFFormatError(f"{path} has no config.json; it is not a Hugging Face model directory")
        try:
            hf_config = json.loads(config_file.read_text())
        except json.JSONDecodeError as error:
            raise HFFormatError(f"{config_file} is not JSON ({error})") from None
        config = llama_config_from_hf(hf_config, str(config_file))
        files = _index(path)
        shapes, dtypes = _headers(files)
        checkpoint = cls(path, hf_config, config, _tokenizer(path, tokenizer_model, tokenizer, config), files, shapes,
                         dtypes,
                         {name: (path / name).read_text() for name in KEPT_FILES if (path / name).exists()})
        checkpoint.sources()  # every tensor present with the config's shape
        return checkpoint

    def sources(self, config: LlamaConfig | None = None) -> dict[str, WeightSource]:
        """dtmega name -> where it is read from, checked against the files: each HF tensor exists,
        with the shape the config gives it. `config`: the model's, when it differs from the
        checkpoint's by untied embeddings (the output layer then starts as a copy of the
        embedding)."""
        config = config or self.config
        expected = model_shapes(config)
        sources, missing, wrong = {}, [], []
        names = set(self.files)
        for name, shape in expected.items():
            source = hf_source(name, config, names)
            sources[name] = source
            want = shape[1:] if source.stacked else shape
            for hf in source.names:
                if hf not in self.shapes:
                    missing.append(hf)
                elif self.shapes[hf] != tuple(want):
                    wrong.append(f"{hf}: {list(self.shapes[hf])} in {self.files[hf].name}, the config gives "
                                 f"{list(want)}")
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise HFFormatError(f"{self.path}: the model needs tensors no shard holds: {', '.join(missing[:5])}{more}. "
                                "Fix: a complete checkpoint of the architecture config.json names")
        if wrong:
            raise HFFormatError(f"{self.path}: tensor shapes disagree with config.json:\n  " + "\n  ".join(wrong[:10])
                                + "\nFix: the config.json that belongs to these weights")
        used = {hf for source in sources.values() for hf in source.names}
        tied = self.config.tie_embeddings or config.tie_embeddings
        unused = sorted(name for name in names - used if not _harmless_extra(name, tied))
        if unused:
            more = f" (and {len(unused) - 6} more)" if len(unused) > 6 else ""
            raise HFFormatError(
                f"{self.path}: the shards hold {len(unused)} tensors the model config.json describes does not use: "
                f"{', '.join(unused[:6])}{more}. A config that disagrees with its weights would load part of them "
                "silently. Fix: the config.json that belongs to these weights (e.g. its num_hidden_layers, "
                "num_local_experts or tie_word_embeddings)")
        return sources

    def load_into(self, module: torch.nn.Module, config: LlamaConfig | None = None) -> None:
        """Fills `module` (a dtmega Llama, sharded by any plan, materialized; under pipeline
        parallelism this rank's stages) with the checkpoint's weights. Each rank reads its own
        regions only, with no collective. `config`: the module's, if it unties the checkpoint's
        tied embeddings (pipeline parallelism: the output layer lives on the last stage)."""
        config = config or self.config
        if config.replace(tie_embeddings=self.config.tie_embeddings) != self.config:
            raise HFFormatError("the model's config differs from the checkpoint's beyond untied embeddings")
        state = get_model_state_dict(module)
        sources = self.sources(config)
        shapes = model_shapes(config)
        reader = HFSafetensorsReader(
            {hf: self.files[hf] for source in sources.values() for hf in source.names}, sources, shapes,
            {name: self.dtypes[sources[name].names[0]] for name in shapes},
        )
        # no_dist: every rank plans and reads its own regions from the files; the reader needs
        # no coordination, so loading takes no collective (any subset of ranks may load, e.g.
        # a sub-mesh of a larger job) and a rank never waits for another.
        with warnings.catch_warnings():  # DCP's "assuming single process" note
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, planner=DataOnlyLoadPlanner(), no_dist=True)
        set_model_state_dict(module, state, options=StateDictOptions(strict=True))


def _harmless_extra(name: str, tied: bool) -> bool:
    """Tensors transformers itself ignores: RoPE's cached frequencies (older checkpoints saved
    them) and a tied model's copy of the embedding as `lm_head.weight`."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied)


def _index(path: Path) -> dict[str, Path]:
    """HF tensor name -> its file, from the index (or the single file); every file checked."""
    index_file = path / INDEX
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise HFFormatError(f"{index_file} is not a safetensors index (no weight_map: {error})") from None
        outside = sorted({str(file) for file in weight_map.values()
                          if not isinstance(file, str) or not is_file_name(file)})
        if outside:
            raise HFFormatError(f"{index_file} names shards outside {path}: {', '.join(outside[:3])}. Refused unread: "
                                "an index names files of its own directory. Fix: the index that belongs to these shards")
        files = {name: path / file for name, file in weight_map.items()}
        odd = sorted({file.name for file in files.values() if file.exists() and not file.is_file()})
        if odd:  # a FIFO or a device named as a shard would block or never end
            raise HFFormatError(f"{index_file} names {', '.join(odd)}, which is not a regular file. "
                                "Fix: copy or download every shard the index lists")
        absent = sorted({file.name for file in files.values() if not file.exists()})
        if absent:
            raise HFFormatError(f"{index_file} names shards that are not in {path}: {', '.join(absent)}. "
                                "Fix: copy or download every shard the index lists")
        return files
    single = path / SINGLE
    if single.exists():
        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}
    raise HFFormatError(f"{path} has neither {INDEX} nor {SINGLE}. Fix: save the model with safetensors "
                        "(transformers' save_pretrained does by default)")


def _headers(files: dict[str, Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    shapes, dtypes = {}, {}
    for file in sorted(set(files.values())):
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as error:  # a damaged header, an unreadable file
            raise HFFormatError(f"{file} is not a readable safetensors file ({error})") from None
        with handle:
            present = set(handle.keys())
            for name in [n for n, f in files.items() if f == file]:
                if name not in present:
                    raise HFFormatError(f"the index puts {name} in {file.name}, which does not hold it. "
                                        "Fix: the index that belongs to these shards")
                piece = handle.get_slice(name)
                shapes[name] = tuple(piece.get_shape())
                kind = piece.get_dtype()
                if kind not in _DTYPES:
                    raise HFFormatError(f"{file.name}: {name} is {kind}; dtmega reads F32, F16, BF16 and F64 weights "
                                        "(a quantized checkpoint must be dequantized first)")
                dtypes[name] = _DTYPES[kind]
    return shapes, dtypes


def _tokenizer(path: Path, tokenizer_model: str | None, tokenizer: Tokenizer | None, config: LlamaConfig) -> Tokenizer:
    source = "--tokenizer-type/--tokenizer-model" if tokenizer is not None else tokenizer_model or str(path)
    if tokenizer is None:
        tokenizer = tokenizer_from_path(source)  # a directory's end-of-document token is its eos_token
    if tokenizer.vocab_size > config.vocab_size:
        raise HFFormatError(
            f"the tokenizer ({source}) has {tokenizer.vocab_size} tokens but the model's embedding only "
            f"{config.vocab_size} rows (vocab_size in config.json): its larger ids would index past the "
            "embedding. Fix: the tokenizer that belongs to this model"
        )
    return tokenizer
