"""A Hugging Face checkpoint directory, opened and checked before any weight is read, and loaded
into a dtmega model sharded by any plan.

`HFCheckpoint.open(dir)` reads `config.json` (mapped by its architecture to a dtmega model's
config: the Llama family and Mixtral, or DeepSeek-V3; hf_architectures.py), the safetensors
index (`model.safetensors.index.json`, or one `model.safetensors`), every shard's
header (names, shapes, dtypes: a few KiB each) and the tokenizer, and checks them against each
other: a shard the index names but the directory lacks, a tensor the model needs but no shard
holds, a shape that disagrees with the config, a tokenizer larger than the embedding. Each is an
HFFormatError naming the file and the fix, raised on every rank alike before any allocation.
`load_into(module)` then fills the module's (sharded) tensors through DCP (hf_reader.py).

FP8 block-quantized checkpoints (DeepSeek-V3's own: `quantization_config.quant_method = "fp8"`,
float8_e4m3 weights with a float32 `weight_scale_inv` per 128 x 128 block) are dequantized as
they are read, each rank only its regions: weight x its block's scale, in float32.
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from dtmega.checkpoint_reader import DataOnlyLoadPlanner, is_file_name
from dtmega.data.tokenizers import Tokenizer, tokenizer_from_path
from dtmega.interop.hf_architectures import HFArchitecture, architecture_of
from dtmega.interop.hf_reader import HFSafetensorsReader
from dtmega.interop.local_model import require_local_dir
from dtmega.kernels.errors import DtmegaError, MissingInput
from dtmega.models.llama.hf_config import HFFormatError
from dtmega.models.llama.hf_names import WeightSource
from dtmega.safe_files import check_regular, read_regular_json, read_regular_text

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Small text files of an HF model directory that a dtmega checkpoint keeps, so that exporting
# it again writes the same config, generation settings, tokenizer settings and chat template.
KEPT_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn}
SCALE_SUFFIX = "_scale_inv"  # DeepSeek's FP8 checkpoints: `<name>.weight_scale_inv` beside `<name>.weight`


@functools.lru_cache(maxsize=8)
def model_shapes(architecture: HFArchitecture, config: Any) -> dict[str, tuple[int, ...]]:
    """Every dtmega tensor's global shape for `config`, from the model built on the meta device
    (no arithmetic of our own to disagree with the model). Built once per config (opening,
    checking and loading a checkpoint each ask; a 671 B model takes seconds to build even on the
    meta device); callers only read the dict."""
    with torch.device("meta"):
        model = architecture.build(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def fp8_block(hf_config: dict, source: str) -> tuple[int, int] | None:
    """The (rows, columns) of an FP8 checkpoint's scale blocks, None for an unquantized one; a
    quantization dtmega does not read is refused with the fix."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != "fp8" or quantization.get("fmt", "e4m3") != "e4m3":
        raise HFFormatError(f"{source}: quantization_config {method!r} ({quantization.get('fmt')}) is not read by dtmega "
                            "(it dequantizes block-scaled fp8 e4m3, DeepSeek-V3's format). Fix: a bf16/fp32 "
                            "checkpoint of the model")
    rows, cols = quantization.get("weight_block_size") or (128, 128)
    return int(rows), int(cols)


@dataclass
class HFCheckpoint:
    """A checked Hugging Face model directory: its config, tokenizer and tensor index."""

    path: Path
    hf_config: dict
    architecture: HFArchitecture
    config: Any  # the dtmega model's (LlamaConfig, DeepSeekConfig)
    tokenizer: Tokenizer | None  # None: the directory has none and the caller converts weights only
    files: dict[str, Path]  # HF tensor name -> its safetensors file
    shapes: dict[str, tuple[int, ...]]  # HF tensor name -> shape
    dtypes: dict[str, torch.dtype]
    kept: dict[str, str] = field(default_factory=dict)  # KEPT_FILES present, as text
    block: tuple[int, int] | None = None  # FP8 scale blocks (rows, columns); None: not quantized
    notes: list[str] = field(default_factory=list)  # what the load changed, for the user

    @property
    def model(self) -> str:
        """The dtmega model spec this checkpoint loads as."""
        return self.architecture.model

    @classmethod
    def open(cls, path: str | Path, tokenizer_model: str | None = None,
             tokenizer: Tokenizer | None = None, *, weights_only: bool = False, flag: str = "--load-hf") -> HFCheckpoint:
        """Opens and checks `path` (see the module docstring); `tokenizer_model` (a path) or
        `tokenizer` (built already, e.g. from a run's --tokenizer-type) overrides the directory's
        own tokenizer files. `weights_only` (converting weights, which needs no tokenizer): a
        directory without tokenizer files opens with `tokenizer` None and a note saying that
        generate, serve and evaluate will need --tokenizer-model. `flag` names the path in errors."""
        path = require_local_dir(path, flag)
        config_file = path / "config.json"
        if not config_file.exists():
            raise HFFormatError(f"{path} has no config.json; it is not a Hugging Face model directory")
        hf_config = read_regular_json(config_file, "config.json of the model")
        architecture = architecture_of(hf_config, str(config_file))
        config = config_of(architecture, hf_config, str(config_file))
        block = fp8_block(hf_config, str(config_file))
        files = _index(path)
        shapes, dtypes = _headers(files, block is not None)
        _layers_in_the_shards(config, shapes, config_file)
        config, notes = _mtp_layers_present(config, set(files), path)
        if weights_only and tokenizer_model is None and tokenizer is None and not has_tokenizer_files(path):
            tokenizer_found = None
            notes.append(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model): the weights are converted; "
                         "dtmega generate, serve and evaluate on the checkpoint will need --tokenizer-model (the "
                         "model's tokenizer.json, tokenizer.model or tokenizer directory)")
        else:
            tokenizer_found = _tokenizer(path, tokenizer_model, tokenizer, config)
        checkpoint = cls(path, hf_config, architecture, config, tokenizer_found,
                         files, shapes, dtypes,
                         {name: read_regular_text(path / name, "the model's file") for name in KEPT_FILES
                          if (path / name).exists()},
                         block, notes)
        checkpoint.sources()  # every tensor present with the config's shape
        return checkpoint

    def scale_of(self, name: str) -> str | None:
        """The `weight_scale_inv` tensor of an FP8 tensor `name`, None for a tensor not quantized."""
        return name + SCALE_SUFFIX if self.dtypes.get(name) == torch.float8_e4m3fn else None

    def _check_scale(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Why the FP8 tensor `name`'s scale is unusable (absent, or not one per block), or None."""
        scale = self.scale_of(name)
        if scale is None:
            return None
        if scale not in self.shapes:
            return f"{name} is fp8 but the shards hold no {scale}"
        rows, cols = self.block
        want = (-(-shape[0] // rows), -(-shape[1] // cols)) if len(shape) == 2 else None
        if want is None or self.shapes[scale] != want:
            return f"{scale}: {list(self.shapes[scale])}, one scale per {rows} x {cols} block of {list(shape)} is {want}"
        return None

    def sources(self, config: Any | None = None) -> dict[str, WeightSource]:
        """dtmega name -> where it is read from, checked against the files: each HF tensor exists,
        with the shape the config gives it. `config`: the model's, when it differs from the
        checkpoint's by untied embeddings (the output layer then starts as a copy of the
        embedding)."""
        config = config or self.config
        expected = model_shapes(self.architecture, config)
        sources, missing, wrong = {}, [], []
        names = set(self.files)
        for name, shape in expected.items():
            source = self.architecture.source(name, config, names, self.hf_config)
            sources[name] = source
            want = source.hf_shape or (shape[1:] if source.stacked else shape)
            for hf in source.names:
                if hf not in self.shapes:
                    missing.append(hf)
                elif self.shapes[hf] != tuple(want):
                    wrong.append(f"{hf}: {list(self.shapes[hf])} in {self.files[hf].name}, the config gives "
                                 f"{list(want)}")
                else:
                    problem = self._check_scale(hf, tuple(want))
                    if problem:
                        wrong.append(problem)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise HFFormatError(f"{self.path}: the model needs tensors no shard holds: {', '.join(missing[:5])}{more}. "
                                "Fix: a complete checkpoint of the architecture config.json names")
        used = {hf for source in sources.values() for hf in source.names}
        used |= {self.scale_of(hf) for hf in used if self.scale_of(hf)}
        tied = config.replace(tie_embeddings=self.config.tie_embeddings or config.tie_embeddings)
        unused = sorted(name for name in names - used if not self.architecture.harmless(name, tied))
        if unused:
            more = f" (and {len(unused) - 6} more)" if len(unused) > 6 else ""
            raise HFFormatError(
                f"{self.path}: the shards hold {len(unused)} tensors the model config.json describes does not use: "
                f"{', '.join(unused[:6])}{more}. A config that disagrees with its weights would load part of them "
                "silently. Fix: the config.json that belongs to these weights (e.g. its num_hidden_layers, "
                "num_local_experts or tie_word_embeddings)")
        # after the unused tensors: a config with fewer experts than its weights also gives its router fewer
        # rows, and the expert tensors it leaves out say what is wrong more plainly than the router's shape
        if wrong:
            raise HFFormatError(f"{self.path}: tensor shapes disagree with config.json:\n  " + "\n  ".join(wrong[:10])
                                + "\nFix: the config.json that belongs to these weights")
        return sources

    def load_into(self, module: torch.nn.Module, config: Any | None = None) -> None:
        """Fills `module` (the dtmega model of `self.model`, sharded by any plan, materialized; under pipeline
        parallelism this rank's stages) with the checkpoint's weights. Each rank reads its own
        regions only, with no collective. `config`: the module's, if it unties the checkpoint's
        tied embeddings (pipeline parallelism: the output layer lives on the last stage)."""
        config = config or self.config
        shapes = model_shapes(self.architecture, config)
        if shapes != model_shapes(self.architecture, self.config):  # routing or loss settings may differ; weights not
            raise HFFormatError("the model's tensors differ from the checkpoint's (names or shapes): its config must "
                                "be the checkpoint's, up to untied embeddings and settings without weights")
        state = get_model_state_dict(module)
        sources = self.sources(config)
        read = {hf for source in sources.values() for hf in source.names}
        scales = {hf: self.scale_of(hf) for hf in read if self.scale_of(hf)}
        reader = HFSafetensorsReader(
            {hf: self.files[hf] for hf in read | set(scales.values())}, sources, shapes,
            {name: _stored_dtype(self.dtypes[sources[name].names[0]]) for name in shapes},
            scales=scales, block=self.block,
        )
        # no_dist: every rank plans and reads its own regions from the files; the reader needs
        # no coordination, so loading takes no collective (any subset of ranks may load, e.g.
        # a sub-mesh of a larger job) and a rank never waits for another.
        with warnings.catch_warnings():  # DCP's "assuming single process" note
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(state, storage_reader=reader, planner=DataOnlyLoadPlanner(), no_dist=True)
            except CheckpointException as wrapped:  # the reader's own refusal, as itself
                for _, (error, _trace) in sorted(wrapped.failures.items()):
                    if isinstance(error, DtmegaError):
                        raise error from None
                raise
        set_model_state_dict(module, state, options=StateDictOptions(strict=True))


def _stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is presented in to DCP: an fp8 one dequantized to float32."""
    return torch.float32 if dtype == torch.float8_e4m3fn else dtype


def _mtp_layers_present(config: Any, names: set[str], path: Path) -> tuple[Any, list[str]]:
    """A DeepSeek config whose `num_nextn_predict_layers` the files do not hold (transformers'
    DeepseekV3ForCausalLM saves no MTP layer; DeepSeek's own checkpoints do): the model is built
    with the depths present, and a note says so."""
    depths = getattr(config, "mtp_num_layers", 0)
    if not depths:
        return config, []
    present = sum(f"model.layers.{config.n_layers + depth}.eh_proj.weight" in names for depth in range(depths))
    if present == depths:
        return config, []
    if present:
        raise HFFormatError(f"{path}: config.json names {depths} multi-token-prediction layers and the shards hold "
                            f"{present} of them. Fix: a complete checkpoint")
    note = (f"{path} holds no multi-token-prediction layer (config.json's num_nextn_predict_layers={depths}; "
            "transformers saves none): the model is loaded without them")
    return config.replace(mtp_num_layers=0), [note]


def _check_position_table(config: Any, source: str) -> None:
    """Refuses a max_position_embeddings whose RoPE table (cos and sin in fp32 for every position)
    would take more than this machine's memory (matrix 3, F6: 10^12 positions were a raw 64 TB
    allocation when the model was built). Serving and generating build the table for the
    positions they use only (`restore(positions=)`), so a long context costs them nothing."""
    from dtmega.train.memory_fit import machine_memory_bytes

    positions, width = getattr(config, "max_seq_len", 0), getattr(config, "head_dim", 0) or 0
    memory = machine_memory_bytes("cuda" if torch.cuda.is_available() else "cpu")
    if memory and positions * width * 4 > memory:
        raise HFFormatError(f"{source}: max_position_embeddings = {positions:,} needs a {positions * width * 4 / 2**30:,.1f} "
                            f"GiB position table, more than this machine's {memory / 2**30:,.1f} GiB. Fix: the "
                            "model's real context length")


def config_of(architecture: HFArchitecture, hf_config: dict, source: str) -> Any:
    """The family's config of `hf_config`: a field that is missing, of the wrong type or out of
    range is one HFFormatError naming the file (and the field, where the reader knows it), never
    a raw KeyError, TypeError or ZeroDivisionError from the reader (matrix 3, F3, F5, F19)."""
    try:
        config = architecture.config_from_hf(hf_config, source)
        _check_position_table(config, source)
        return config
    except DtmegaError as error:
        if isinstance(error, HFFormatError) or str(error).startswith(source):
            raise
        raise HFFormatError(f"{source}: {error}") from None
    except KeyError as error:
        raise HFFormatError(f"{source}: {error.args[0]} is missing. Fix: the model's complete config.json") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError) as error:
        raise HFFormatError(f"{source}: a field is of the wrong type or out of range ({type(error).__name__}: "
                            f"{error}). Fix: the model's own config.json") from None


_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def _layers_in_the_shards(config: Any, shapes: dict[str, tuple[int, ...]], config_file: Path) -> None:
    """Refuses a config.json that names more layers than the shards hold, from the tensor names
    alone, before any model (even on the meta device) is built: 10^6 layers over 2 layers of
    weights took 5 GB and minutes to build before the comparison that refused it (matrix 3, F2)."""
    wanted = getattr(config, "n_layers", None)
    present = {int(match.group(1)) for name in shapes if (match := _LAYER_NAME.search(name))}
    if isinstance(wanted, int) and present and wanted > max(present) + 1:
        raise HFFormatError(f"{config_file}: num_hidden_layers (n_layer) is {wanted}, but the shards hold layers 0.."
                            f"{max(present)} only. Fix: the config.json that belongs to these weights")


def _index(path: Path) -> dict[str, Path]:
    """HF tensor name -> its file, from the index (or the single file); every file checked."""
    index_file = path / INDEX
    if index_file.exists():
        try:
            weight_map = read_regular_json(index_file, "the safetensors index")["weight_map"]
        except (KeyError, TypeError) as error:
            raise HFFormatError(f"{index_file} is not a safetensors index (no weight_map: {error})") from None
        if not isinstance(weight_map, dict):  # matrix 3, F13: a list was a raw AttributeError
            raise HFFormatError(f"{index_file} is not a safetensors index (weight_map is a {type(weight_map).__name__}, "
                                "not an object of tensor name -> file). Fix: the index that belongs to these shards")
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
        check_regular(single, "the model's weights")
        try:
            with safe_open(str(single), framework="pt") as handle:
                return {name: single for name in handle.keys()}
        except (SafetensorError, OSError) as error:  # matrix 3, F8: a lying header was a raw traceback
            raise HFFormatError(f"{single} is not a readable safetensors file ({error})") from None
    raise HFFormatError(f"{path} has neither {INDEX} nor {SINGLE}. Fix: save the model with safetensors "
                        "(transformers' save_pretrained does by default)")


def _headers(files: dict[str, Path], quantized: bool) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
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
                if kind not in _DTYPES or (kind == "F8_E4M3" and not quantized):
                    raise HFFormatError(f"{file.name}: {name} is {kind}; dtmega reads F32, F16, BF16 and F64 weights, "
                                        "and F8_E4M3 ones with block scales (quantization_config quant_method "
                                        "'fp8'). Fix: a dequantized checkpoint, or the config.json that belongs to it")
                dtypes[name] = _DTYPES[kind]
    return shapes, dtypes


def has_tokenizer_files(path: Path) -> bool:
    """Whether the model directory `path` holds a tokenizer dtmega reads (tokenizer.json or a
    SentencePiece tokenizer.model), as `tokenizer_from_path` looks for them."""
    return any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model"))


def _tokenizer(path: Path, tokenizer_model: str | None, tokenizer: Tokenizer | None, config: Any) -> Tokenizer:
    source = "--tokenizer-type/--tokenizer-model" if tokenizer is not None else tokenizer_model or str(path)
    if tokenizer is None and tokenizer_model is None and not has_tokenizer_files(path):
        raise MissingInput(f"{path} holds neither tokenizer.json nor tokenizer.model. Fix: --tokenizer-model with the "
                           "model's tokenizer (tokenizer.json, tokenizer.model or its directory); converting the weights "
                           "alone (dtmega convert hf-to-dtmega) needs none")
    if tokenizer is None:
        tokenizer = tokenizer_from_path(source)  # a directory's end-of-document token is its eos_token
    if tokenizer.vocab_size > config.vocab_size:
        raise HFFormatError(
            f"the tokenizer ({source}) has {tokenizer.vocab_size} tokens but the model's embedding only "
            f"{config.vocab_size} rows (vocab_size in config.json): its larger ids would index past the "
            "embedding. Fix: the tokenizer that belongs to this model"
        )
    return tokenizer
