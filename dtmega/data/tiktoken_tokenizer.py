"""Megatron's TikTokenizer (`--tokenizer-type TikTokenizer --tokenizer-model vocab.json`): a
byte-level BPE given as a JSON list of `{"rank", "token_bytes", "token_str"}` entries (the format
of Megatron's and Mistral's tiktoken vocabularies), encoded by OpenAI's `tiktoken` library as
Megatron-Core does it (megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py, 0.16):

- ids 0..N-1 are N = `--tiktoken-num-special-tokens` (default 1000) special tokens: the given
  `--tiktoken-special-tokens` (default `<unk> <s> </s> <mask> <pad> <cls> <sep>`), then
  `<SPECIAL_k>` fillers; `</s>` is the end of document;
- the vocabulary's ranks follow, shifted by N, cut to `--vocab-size` (default 2^17) minus N;
- text is split by the `--tiktoken-pattern` regex (v1 or v2, the default) and special-token
  text in it is encoded as the special token (Megatron's `allowed_special="all"`).

`tests/unit/test_tiktoken_tokenizer.py` holds the ids equal to megatron-core's own tokenizer.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dtmega.kernels.errors import DtmegaError
from dtmega.safe_files import TOKENIZER_LIMIT, read_regular_text

# The split regexes Megatron-Core names v1 and v2 (data: the ids depend on them exactly).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
          r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+",
}
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2 ** 17
DEFAULT_NUM_SPECIAL_TOKENS = 1000


@dataclass(frozen=True)
class TikTokenSettings:
    """The TikTokenizer flags, with Megatron-Core's defaults."""

    pattern: str = "v2"
    num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS
    special_tokens: tuple[str, ...] | None = None
    vocab_size: int | None = None

    def checked(self) -> "TikTokenSettings":
        """These settings, or a DtmegaError naming the flag that cannot work."""
        if self.pattern not in PATTERNS:
            raise DtmegaError(f"--tiktoken-pattern {self.pattern!r}: Megatron's patterns are v1 and v2. Fix: "
                              "--tiktoken-pattern v2 (the default)")
        vocab = self.vocab_size or DEFAULT_VOCAB_SIZE
        special = self.special_tokens or REQUIRED_SPECIAL_TOKENS
        missing = [token for token in REQUIRED_SPECIAL_TOKENS if token not in special]
        if missing or len(set(special)) != len(special):
            raise DtmegaError(f"--tiktoken-special-tokens {' '.join(special)}: they must be distinct and include "
                              f"{' '.join(REQUIRED_SPECIAL_TOKENS)} (missing: {' '.join(missing) or 'none'}). Fix: "
                              "add them, or leave the flag out")
        if not len(special) <= self.num_special_tokens < vocab:
            raise DtmegaError(f"--tiktoken-num-special-tokens {self.num_special_tokens} must hold the {len(special)} "
                              f"special tokens and be below the vocabulary size {vocab} (--vocab-size). Fix: a count "
                              f"from {len(special)} to {vocab - 1}")
        return TikTokenSettings(self.pattern, self.num_special_tokens, tuple(special), vocab)


def read_ranks(path: str | Path, needed: int) -> list[dict]:
    """The first `needed` entries of a tiktoken vocabulary file, checked as Megatron checks them
    (a list whose i-th entry has rank i, the first 256 the single bytes)."""
    path = Path(path)
    if path.suffix != ".json" or not path.exists():
        raise DtmegaError(f"--tokenizer-model {path}: TikTokenizer reads a .json vocabulary (a list of rank, "
                          "token_bytes, token_str entries). Fix: the tokenizer's .json file")
    try:
        entries = json.loads(read_regular_text(path, "--tokenizer-model", TOKENIZER_LIMIT))
    except ValueError as error:
        raise DtmegaError(f"--tokenizer-model {path} is not JSON ({error}). Fix: the tokenizer's .json file") from None
    return check_ranks(entries, needed, str(path))


def check_ranks(entries: object, needed: int, where: str) -> list[dict]:
    """`entries` cut to `needed`, or a DtmegaError naming the first entry that is not a rank."""
    if not isinstance(entries, list):
        raise DtmegaError(f"{where}: a tiktoken vocabulary is a JSON list of rank entries. Fix: the tokenizer's .json")
    if len(entries) < needed:
        raise DtmegaError(f"{where} holds {len(entries)} ranks, but --vocab-size minus the special tokens needs "
                          f"{needed}. Fix: --vocab-size {len(entries)} + --tiktoken-num-special-tokens at most")
    entries = entries[:needed]
    for i, entry in enumerate(entries):
        ok = isinstance(entry, dict) and set(entry) == {"rank", "token_bytes", "token_str"} and entry["rank"] == i
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True) if ok else b""
        except (ValueError, TypeError):
            ok = False
        if not ok or (i < 256 and token != bytes([i])):
            raise DtmegaError(f"{where}: entry {i} is not rank {i} of a byte-level vocabulary ({str(entry)[:80]}). "
                              "Fix: the tokenizer's own .json file")
    return entries


class TikTokenizer:
    """Megatron-Core's TikTokenizer: tiktoken's BPE over the ranks, special tokens first."""

    def __init__(self, entries: list[dict], settings: TikTokenSettings):
        import tiktoken

        self.settings = settings = settings.checked()
        special = list(settings.special_tokens or ()) + [f"<SPECIAL_{i}>" for i in range(
            len(settings.special_tokens or ()), settings.num_special_tokens)]
        self.special_tokens = special
        self.entries = entries
        shift = settings.num_special_tokens
        self.ranks = {base64.b64decode(entry["token_bytes"]): entry["rank"] + shift for entry in entries}
        if len(self.ranks) != len(entries):
            raise DtmegaError("the tiktoken vocabulary lists a token twice. Fix: the tokenizer's own .json file")
        self.encoding = tiktoken.Encoding(name="dtmega-tiktoken", pat_str=PATTERNS[settings.pattern],
                                          mergeable_ranks=self.ranks,
                                          special_tokens={token: i for i, token in enumerate(special)})
        self.vocab_size = int(settings.vocab_size or DEFAULT_VOCAB_SIZE)
        self.eod_token = "</s>"
        self.eod = special.index("</s>")

    @classmethod
    def from_file(cls, path: str | Path, settings: TikTokenSettings) -> "TikTokenizer":
        """The tokenizer of a vocabulary file and the TikTokenizer flags."""
        settings = settings.checked()
        return cls(read_ranks(path, int(settings.vocab_size) - settings.num_special_tokens), settings)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        pieces = []
        for i in ids:
            i = int(i)
            pieces.append(self.special_tokens[i].encode() if i < len(self.special_tokens)
                          else self.encoding.decode_single_token_bytes(i))
        return b"".join(pieces).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        """The tokenizer as a checkpoint carries it: its settings and its ranks."""
        settings = {**asdict(self.settings), "special_tokens": list(self.settings.special_tokens or ())}
        return json.dumps({"dtmega_tokenizer": "tiktoken", **settings, "ranks": self.entries})

    @classmethod
    def from_json(cls, text: str) -> "TikTokenizer":
        """`to_json()` read back."""
        saved = json.loads(text)
        settings = TikTokenSettings(saved["pattern"], saved["num_special_tokens"], tuple(saved["special_tokens"]),
                                    saved["vocab_size"])
        return cls(check_ranks(saved["ranks"], len(saved["ranks"]), "the checkpoint's tokenizer"), settings)

    def as_huggingface(self):
        """The same ids as a Hugging Face `tokenizers` byte-level BPE (for an export): the merges
        recovered from the ranks (each token's bytes merged by the lower ranks until two parts
        remain), the pattern as a Split before the byte-level step, whole pieces in the vocabulary
        taken as one token as tiktoken takes them (`ignore_merges`), the special tokens as added
        tokens with their ids."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizerModel

        from dtmega.data.byte_level import byte_symbols

        symbols = byte_symbols()

        def text_of(token: bytes) -> str:
            return "".join(symbols[b] for b in token)

        vocab = {token: i for i, token in enumerate(self.special_tokens)}
        vocab.update({text_of(token): rank for token, rank in self.ranks.items()})
        merges = []
        for token, rank in sorted(self.ranks.items(), key=lambda item: item[1]):
            if len(token) > 1:
                left, right = _last_merge(self.ranks, token, rank)
                merges.append((text_of(left), text_of(right)))
        model = HFTokenizerModel(models.BPE(vocab, merges, ignore_merges=True))
        model.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERNS[self.settings.pattern]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        model.decoder = decoders.ByteLevel()
        model.add_special_tokens(self.special_tokens)
        return model


def _last_merge(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    """The two parts whose merge makes `token`: its bytes merged by every rank below its own."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            found = ranks.get(parts[i] + parts[i + 1])
            if found is not None and found < rank and (best is None or found < best[1]):
                best = (i, found)
        if best is None:
            break
        i = best[0]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise DtmegaError(f"the tiktoken vocabulary's token {token!r} (rank {rank}) is not the merge of two lower "
                          "ranks, so it has no BPE merge for a Hugging Face export")
    return parts[0], parts[1]
