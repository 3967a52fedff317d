"""The data section of `dtmega train`'s arguments: datasets, split, tokenizer, documents, order."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dtmega.data.tokenizers import TOKENIZER_TYPES
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class DataArgs:
    """The data: dataset prefixes and split, tokenizer, document handling, order."""
    # sizes and counts that must be >= 1 when given
    at_least_one: ClassVar[tuple[str, ...]] = ("vocab_size", "tiktoken_num_special_tokens")

    data_path: list[str] = _opt([], "dataset prefix(es), optionally weighted: 0.3 a 0.7 b")
    train_data_path: list[str] | None = _opt(None, "the training split's own dataset prefix(es), weighted as "
                                                   "--data-path (instead of --data-path and --split)")
    valid_data_path: list[str] | None = _opt(None, "the validation split's own dataset prefix(es) (none: no "
                                                   "validation)")
    test_data_path: list[str] | None = _opt(None, "the test split's own dataset prefix(es): evaluated once at the "
                                                  "end of the run, --eval-iters batches")
    data_cache_path: str | None = _opt(None, "directory for the sample indices built from the data (default: beside "
                                             "each dataset; for data on a read-only file system)")
    no_mmap_bin_files: bool = _opt(False, "read .bin files with file reads instead of memory mapping them (for file "
                                           "systems where mapping is slow or not allowed; no effect with --mock-data)")
    mock_data: bool = _opt(False, "synthetic samples of the run's shape instead of --data-path (random ids of the "
                                  "tokenizer's vocabulary: for trying a launch line before the data exists)")
    split: str = _opt("969,30,1", "train,valid,test document proportions")
    tokenizer_type: str | None = _opt(None, "tokenizer used by preprocessing", TOKENIZER_TYPES)
    tokenizer_model: str | None = _opt(None, "tokenizer.json or a Hugging Face directory (HuggingFaceTokenizer), a "
                                             "SentencePiece tokenizer.model (Llama2Tokenizer, GPTSentencePieceTokenizer), "
                                             "a tiktoken vocabulary .json (TikTokenizer)")
    vocab_size: int | None = _opt(None, "NullTokenizer (pre-tokenized data): the token ids are 0..N-1, N is "
                                        "end-of-document; TikTokenizer: its vocabulary size (default 131072)")
    tiktoken_pattern: str | None = _opt(None, "TikTokenizer: the split regex, v1 or v2 (default v2)", ("v1", "v2"))
    tiktoken_num_special_tokens: int = _opt(1000, "TikTokenizer: the number of special-token ids before the "
                                                  "vocabulary's ranks")
    tiktoken_special_tokens: list[str] | None = _opt(None, "TikTokenizer: the special tokens (default <unk> <s> </s> "
                                                           "<mask> <pad> <cls> <sep>; the rest are <SPECIAL_k> fillers)")
    vocab_file: str | None = _opt(None, "vocab.json (GPT2BPETokenizer)")
    merge_file: str | None = _opt(None, "merges.txt (GPT2BPETokenizer)")
    eod_token: str | None = _opt(None, "end-of-document token (default: found in the vocabulary)")
    eod_mask_loss: bool = _opt(False, "no loss on positions whose input is end-of-document")
    reset_position_ids: bool = _opt(False, "restart position ids after each end-of-document")
    reset_attention_mask: bool = _opt(False, "attention causal within each document of a sample, not across its "
                                             "end-of-document tokens (the DocumentMasking pass)")
    sft: bool = _opt(False, "supervised fine-tuning on packed chat samples (--data-path: the prefix `dtmega preprocess "
                            "--chat` wrote): loss on the assistant's tokens, attention within each conversation")
    dataloader_type: str = _opt("single", "single: the dataset's own (shuffled) order; cyclic: also a fresh "
                                          "shuffle of the samples every pass (resumable)", ("single", "cyclic"))

    def document_passes(self) -> list:
        """DocumentMasking when --reset-attention-mask asks for attention within documents."""
        from dtmega.passes import DocumentMasking

        return [DocumentMasking()] if self.reset_attention_mask or self.sft else []

    @property
    def per_split_paths(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None:
        """(train, valid, test) prefixes of --train/--valid/--test-data-path, or None when the
        run reads --data-path with --split."""
        given = (self.train_data_path, self.valid_data_path, self.test_data_path)
        if not any(given):
            return None
        return tuple(tuple(paths or ()) for paths in given)  # type: ignore[return-value]

    @property
    def data_prefixes(self) -> list[str]:
        """Every dataset prefix the run reads, whichever flags name them (weights left out)."""
        from dtmega.data.blend import parse_data_path

        lists = [self.data_path] if self.data_path else [paths for paths in self.per_split_paths or () if paths]
        return [prefix for items in lists for _, prefix in parse_data_path(list(items))]

    def check_data_source(self) -> list[str]:
        """Refuses data flags that contradict each other (Megatron's rules), naming the flag to
        drop; returns notes for flags that then have no effect."""
        per_split = self.per_split_paths
        sources = [flag for flag, given in (("--data-path", bool(self.data_path)), ("--mock-data", self.mock_data),
                                            ("--train/valid/test-data-path", per_split is not None)) if given]
        if len(sources) > 1:
            raise ArgumentError(f"{' and '.join(sources)} both say where the samples come from. Fix: keep one")
        if self.sft and (len(self.data_path) != 1 or self.per_split_paths is not None):
            raise ArgumentError("--sft reads one packed chat file: --data-path PREFIX (as `dtmega preprocess --chat "
                                "--output-prefix PREFIX` wrote it), split by --split")
        if not sources:
            raise ArgumentError("dtmega train needs data: --data-path (with --split), --train-data-path (and "
                                "--valid-data-path), or --mock-data")
        if per_split is None:
            return []
        if not per_split[0]:
            raise ArgumentError("--valid-data-path/--test-data-path without --train-data-path: nothing to train on. "
                                "Fix: add --train-data-path PREFIX")
        notes = []
        if self.split != "969,30,1":
            notes.append(f"--split {self.split} is not read: each split has its own --*-data-path")
        if not per_split[1]:
            notes.append("no --valid-data-path: this run has no validation (add one to validate)")
        return notes

    @property
    def split_weights(self) -> tuple[float, float, float]:
        """--split as three floats, read as Megatron reads it: the numbers in the text, whatever
        separates them ("969,30,1", "99/1/0", or "'99,1,0'" with the quotes a launch script left
        in), a missing part 0."""
        numbers = re.findall(r"\d+(?:\.\d*)?|\.\d+", self.split)
        leftover = re.sub(r"\d+(?:\.\d*)?|\.\d+|[\s,/'\"]", "", self.split)
        if not numbers or len(numbers) > 3 or leftover:
            raise ArgumentError(f"--split {self.split!r} must be up to three numbers such as 969,30,1 (train, "
                                "validation and test proportions)")
        parts = [float(x) for x in numbers] + [0.0] * (3 - len(numbers))
        if sum(parts) <= 0:
            raise ArgumentError(f"--split {self.split!r} gives no document to any part. Fix: e.g. 969,30,1")
        return tuple(parts)  # type: ignore[return-value]
