"""Tokenizers chosen the way Megatron's --tokenizer-type chooses them, built on HF `tokenizers`.

Nothing is fetched from a hub: every tokenizer comes from local files (or is the byte
tokenizer, or is trained on the input).
"""

from __future__ import annotations

import base64
import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np
from tokenizers import Tokenizer as HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers, trainers

from dtmega.data.byte_level import byte_symbols
from dtmega.kernels.errors import DtmegaError, MissingInput
from dtmega.safe_files import TOKENIZER_LIMIT, check_regular, read_regular_bytes, read_regular_json

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer",
                   "TikTokenizer", "NullTokenizer", "byte")
# Megatron's SentencePiece types: a `tokenizer.model` given as --tokenizer-model
SENTENCEPIECE_TYPES = ("Llama2Tokenizer", "GPTSentencePieceTokenizer")
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
BPE_EOD = "<|endoftext|>"


class Tokenizer(Protocol):
    """What preprocessing, training and generation need from a tokenizer."""

    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Byte-level: ids 0-255 are the UTF-8 bytes; 256 is end-of-document, 257 padding."""

    vocab_size = 258
    eod = 256
    pad = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as a uint16 array, without a Python list (preprocessing's hot path)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"dtmega_tokenizer": "byte"})

    def as_huggingface(self) -> HFTokenizerModel:
        """The same tokenizer as a `tokenizers` model (what a Hugging Face export carries): a
        byte-level BPE without merges whose ids are the bytes, <|endoftext|> = 256, <|pad|> = 257."""
        vocab = {char: byte for byte, char in byte_symbols().items()}
        vocab.update({BPE_EOD: self.eod, "<|pad|>": self.pad})
        model = HFTokenizerModel(models.BPE(vocab, merges=[]))
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        model.decoder = decoders.ByteLevel()
        model.add_special_tokens([BPE_EOD, "<|pad|>"])
        return model


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer with a known end-of-document token."""

    def __init__(self, model: HFTokenizerModel, eod_token: str | None = None):
        self.model = model
        self.vocab_size = model.get_vocab_size(with_added_tokens=True)
        vocab = model.get_vocab(with_added_tokens=True)
        candidates = (eod_token,) if eod_token else EOD_CANDIDATES
        found = [token for token in candidates if token in vocab]
        if not found:
            wanted = repr(eod_token) if eod_token else f"any of {list(EOD_CANDIDATES)}"
            raise DtmegaError(
                f"the tokenizer has no end-of-document token ({wanted} not in its vocabulary). "
                "Fix: pass --eod-token with a token it has"
            )
        self.eod_token = found[0]
        self.eod = vocab[self.eod_token]

    # Texts longer than this are encoded in pieces cut at a single space between two non-space
    # characters, where every whitespace-splitting pre-tokenizer (GPT-2's and Llama 3's regexes)
    # has a boundary anyway: the ids are the same, the memory is not (`tokenizers` holds ~180
    # bytes per character of one input: a 50 MB line peaked at 9.1 GB).
    LONG_TEXT = 1 << 20
    _CUT = re.compile(r"(?<=\S) (?=\S)")

    def encode(self, text: str) -> list[int]:
        if len(text) <= self.LONG_TEXT or not self.splits_at_spaces:
            return self._encode(text)
        ids: list[int] = []
        start = 0
        while start < len(text):
            cut = self._CUT.search(text, start + self.LONG_TEXT) if len(text) - start > self.LONG_TEXT else None
            end = cut.start() if cut else len(text)
            ids += self._encode(text[start:end])
            start = end
        return ids

    def _encode(self, text: str) -> list[int]:
        """tokenizers' encode; its Rust panic (a pre-tokenizer regex past Oniguruma's retry limit, a
        BaseException that nothing catches) becomes a TokenizerTextError naming the text's fault
        (matrix 3, C12)."""
        try:
            return self.model.encode(text, add_special_tokens=False).ids
        except BaseException as error:  # noqa: BLE001 - pyo3's PanicException derives from BaseException
            if type(error).__name__ != "PanicException":
                raise
            raise TokenizerTextError(f"the tokenizer gave up on this text ({str(error).splitlines()[0][:160]}): its "
                                     "pre-tokenizer's regular expression backtracks without end on it. Fix: another "
                                     "tokenizer, or leave such text out") from None

    @functools.cached_property
    def splits_at_spaces(self) -> bool:
        """Whether the pre-tokenizer always splits before a space that follows a non-space
        character (byte-level BPE with its regex, alone or after a regex Split, as GPT-2, Llama 3
        and the BPE `dtmega preprocess --train-tokenizer` makes): then a long text can be
        encoded in pieces with the same ids."""
        config = json.loads(self.model.to_str()).get("pre_tokenizer") or {}
        steps = config.get("pretokenizers", [config]) if config.get("type") == "Sequence" else [config]
        if not steps or any(step.get("type") not in ("ByteLevel", "Split") for step in steps):
            return False
        first = steps[0]
        regex = (first.get("pattern") or {}).get("Regex", "") if first.get("type") == "Split" else ""
        return r"\s+(?!\S)" in regex or (first.get("type") == "ByteLevel" and first.get("use_regex", True))

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        return self.model.to_str()


class SentencePieceTokenizer:
    """A SentencePiece `tokenizer.model` (Llama 2, Mistral, Megatron's GPTSentencePieceTokenizer
    models), encoded by the sentencepiece library itself so ids match the model's training."""

    def __init__(self, proto: bytes, eod_token: str | None = None):
        import sentencepiece

        self.proto = proto
        self.model = sentencepiece.SentencePieceProcessor(model_proto=proto)
        self.vocab_size = self.model.get_piece_size()
        if eod_token is not None:
            eod = self.model.piece_to_id(eod_token)
            if self.model.id_to_piece(eod) != eod_token:
                raise DtmegaError(f"the SentencePiece model has no token {eod_token!r}. Fix: pass --eod-token with a "
                                 "token it has")
        else:
            eod = self.model.eos_id()
            if eod < 0:
                raise DtmegaError("the SentencePiece model has no end-of-sentence token. Fix: pass --eod-token with a "
                                 "token it has")
        self.eod = eod
        self.eod_token = self.model.id_to_piece(eod)

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode([int(i) for i in ids])

    def to_json(self) -> str:
        return json.dumps({"dtmega_tokenizer": "sentencepiece", "eod_token": self.eod_token,
                           "model": base64.b64encode(self.proto).decode("ascii")})


class NullTokenizer:
    """Megatron's NullTokenizer for data that is already token ids (--tokenizer-type
    NullTokenizer --vocab-size N): ids 0..N-1 are tokens, N is end-of-document (so the
    vocabulary is N + 1); text is whitespace-separated ids."""

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise DtmegaError(f"--vocab-size {vocab_size}: NullTokenizer needs at least one token id")
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(piece) for piece in text.split()]
        except ValueError:
            raise DtmegaError("NullTokenizer reads text as whitespace-separated token ids; this text is not. Fix: "
                              "a tokenizer for the text (--tokenizer-type HuggingFaceTokenizer ...)") from None
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise DtmegaError(f"NullTokenizer: an id outside 0..{self.vocab_size - 1} (--vocab-size {self.eod})")
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def to_json(self) -> str:
        return json.dumps({"dtmega_tokenizer": "null", "vocab_size": self.eod})


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a tokenizer comes from; picklable, so worker processes can rebuild it."""

    tokenizer_type: str = "byte"
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    eod_token: str | None = None
    vocab_size: int | None = None  # NullTokenizer's and TikTokenizer's --vocab-size
    # TikTokenizer's --tiktoken-pattern, --tiktoken-num-special-tokens, --tiktoken-special-tokens
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int | None = None
    tiktoken_special_tokens: tuple[str, ...] | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _require_file(path: str | None, flag: str, kind: str) -> Path:
    if not path:
        raise DtmegaError(f"--tokenizer-type {kind} needs {flag}")
    if not Path(path).exists():
        raise MissingInput(f"{flag} {path} does not exist")
    return Path(path)


class TokenizerTextError(DtmegaError):
    """A text the tokenizer cannot encode (its own failure on this input, not the tokenizer file's)."""


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer `spec` describes; a clear error for a missing or inconsistent file."""
    if spec.tokenizer_type == "byte":
        return ByteTokenizer()
    if spec.tokenizer_type == "HuggingFaceTokenizer":
        path = _require_file(spec.tokenizer_model, "--tokenizer-model (tokenizer.json, tokenizer.model or a "
                             "Hugging Face tokenizer directory)", spec.tokenizer_type)
        return tokenizer_from_path(path, spec.eod_token)
    if spec.tokenizer_type in SENTENCEPIECE_TYPES:
        path = _require_file(spec.tokenizer_model, "--tokenizer-model (the SentencePiece tokenizer.model)",
                             spec.tokenizer_type)
        if path.is_dir() or path.suffix == ".json":
            raise DtmegaError(f"--tokenizer-type {spec.tokenizer_type} reads a SentencePiece tokenizer.model; "
                              f"{path} is not one. Fix: --tokenizer-type HuggingFaceTokenizer for a tokenizer.json "
                              "or a Hugging Face directory")
        return SentencePieceTokenizer(read_regular_bytes(path, "--tokenizer-model", TOKENIZER_LIMIT), spec.eod_token)
    if spec.tokenizer_type == "NullTokenizer":
        if spec.vocab_size is None:
            raise DtmegaError("--tokenizer-type NullTokenizer needs --vocab-size (the token ids are 0..N-1; N is "
                              "end-of-document)")
        return NullTokenizer(spec.vocab_size)
    if spec.tokenizer_type == "TikTokenizer":
        from dtmega.data.tiktoken_tokenizer import TikTokenizer, TikTokenSettings

        path = _require_file(spec.tokenizer_model, "--tokenizer-model (the tiktoken vocabulary .json)", spec.tokenizer_type)
        settings = TikTokenSettings(spec.tiktoken_pattern or "v2", spec.tiktoken_num_special_tokens or 1000,
                                    spec.tiktoken_special_tokens, spec.vocab_size)
        return TikTokenizer.from_file(path, settings)
    if spec.tokenizer_type == "GPT2BPETokenizer":
        vocab = _require_file(spec.vocab_file, "--vocab-file (vocab.json)", spec.tokenizer_type)
        merges = _require_file(spec.merge_file, "--merge-file (merges.txt)", spec.tokenizer_type)
        model = HFTokenizerModel(models.BPE.from_file(str(check_regular(vocab, "--vocab-file")),
                                                      str(check_regular(merges, "--merge-file"))))
        model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = decoders.ByteLevel()
        return HuggingFaceTokenizer(model, spec.eod_token or BPE_EOD)
    raise DtmegaError(f"--tokenizer-type {spec.tokenizer_type!r} is unknown; use one of {TOKENIZER_TYPES}")


def tokenizer_from_json(text: str, eod_token: str | None = None) -> Tokenizer:
    """Rebuilds a tokenizer from `to_json()` output (how checkpoints carry their tokenizer)."""
    if text.lstrip().startswith('{"dtmega_tokenizer": "byte"'):
        return ByteTokenizer()
    if text.lstrip().startswith('{"dtmega_tokenizer": "null"'):
        return NullTokenizer(int(json.loads(text)["vocab_size"]))
    if text.lstrip().startswith('{"dtmega_tokenizer": "tiktoken"'):
        from dtmega.data.tiktoken_tokenizer import TikTokenizer

        return TikTokenizer.from_json(text)
    if text.lstrip().startswith('{"dtmega_tokenizer": "sentencepiece"'):
        saved = json.loads(text)
        return SentencePieceTokenizer(base64.b64decode(saved["model"]), eod_token or saved["eod_token"])
    return HuggingFaceTokenizer(HFTokenizerModel.from_str(text), eod_token)


def tokenizer_from_path(path: str | Path, eod_token: str | None = None) -> Tokenizer:
    """The tokenizer at `path` in any form Megatron users pass to --tokenizer-model: a
    `tokenizer.json` (HF tokenizers), a SentencePiece `tokenizer.model`, or a Hugging Face
    tokenizer directory holding either (tokenizer.json preferred)."""
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).exists():
                return tokenizer_from_path(path / name, eod_token or directory_eos_token(path))
        raise MissingInput(f"--tokenizer-model {path}: the directory holds neither tokenizer.json nor "
                                "tokenizer.model. Fix: the directory the model's tokenizer was saved to")
    if not path.exists():
        raise MissingInput(f"--tokenizer-model {path} does not exist")
    data = read_regular_bytes(path, "--tokenizer-model", TOKENIZER_LIMIT)
    if data.lstrip()[:1] == b"{":
        text = data.decode("utf-8")
        if not text.lstrip().startswith('{"dtmega_tokenizer"'):
            try:
                HFTokenizerModel.from_str(text)
            except Exception as error:  # tokenizers raises a plain Exception for a file it cannot read
                raise DtmegaError(f"--tokenizer-model {path} is JSON but not a tokenizers file ({error}). "
                                 "Fix: the model's tokenizer.json") from None
        return tokenizer_from_json(text, eod_token)
    try:
        return SentencePieceTokenizer(data, eod_token)
    except RuntimeError as error:  # sentencepiece's message for a file that is not a model proto
        raise DtmegaError(f"--tokenizer-model {path} is neither a tokenizer.json nor a SentencePiece model ({error}). "
                         "Fix: tokenizer.json, tokenizer.model, or the Hugging Face tokenizer directory") from None


def directory_eos_token(path: Path) -> str | None:
    """The end-of-text token a Hugging Face tokenizer directory's tokenizer_config.json names
    (None: none named, dtmega's usual candidates apply). Used as the end-of-document token, so
    preprocessing, training and generation from that directory agree on it."""
    settings = Path(path) / "tokenizer_config.json"
    if not settings.exists():
        return None
    value = read_regular_json(settings, "the tokenizer settings")
    if not isinstance(value, dict):  # matrix 3, C11: a list was a raw AttributeError
        raise DtmegaError(f"{settings} holds a {type(value).__name__}, not a JSON object. Fix: the tokenizer's own "
                          "tokenizer_config.json")
    token = value.get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None and not isinstance(token, str):
        raise DtmegaError(f"{settings}: eos_token = {token!r} is not a token (a string, or an object with its "
                          "content). Fix: the tokenizer's own tokenizer_config.json")
    return token


def train_bpe(texts: Iterable[str], vocab_size: int, save_to: Path) -> HuggingFaceTokenizer:
    """Trains a byte-level BPE on `texts` (GPT-2 style, <|endoftext|> as end of document) and
    saves it as a tokenizers JSON file."""
    if vocab_size < 257 + 1:
        raise DtmegaError(f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least 258 tokens")
    model = HFTokenizerModel(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BPE_EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(texts, trainer=trainer)
    save_to.parent.mkdir(parents=True, exist_ok=True)
    tmp = save_to.with_suffix(".json.tmp")
    model.save(str(tmp))
    tmp.replace(save_to)
    return HuggingFaceTokenizer(model, BPE_EOD)
