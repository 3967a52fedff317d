"""The packed chat samples `dtmega preprocess --chat` wrote (dtmega/data/chat_data.py), as the
datasets `dtmega train --sft` reads: each sample is tokens, loss flags and conversation ids of
--seq-length + 1 positions, and a batch of them becomes tokens, labels, a loss mask on the
assistant's tokens, positions restarting per conversation and the document ids that mask
attention to each conversation. Splits take consecutive samples by --split's weights; a split
read past its end starts over (epochs), like the GPT datasets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from dtmega.batch import make_batch
from dtmega.data.chat_data import FORMAT
from dtmega.data.tokenizer_reference import tokenizer_from_reference
from dtmega.data.tokenizers import Tokenizer
from dtmega.kernels.document_attention import positions_from_documents
from dtmega.kernels.errors import DtmegaError
from dtmega.safe_files import read_regular_json


def read_header(prefix: str) -> dict:
    """`<prefix>_sft.json`; DtmegaError naming the fix when it is missing or not an SFT file."""
    path = Path(f"{prefix}_sft.json")
    if not path.is_file():
        raise DtmegaError(f"--sft reads {path}, which does not exist. Fix: dtmega preprocess --chat --output-prefix "
                          f"{prefix} ... (or drop --sft for pretraining data)")
    header = read_regular_json(path, "the chat data's header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DtmegaError(f"{path} is not a {FORMAT} file. Fix: make it with dtmega preprocess --chat")
    for field in ("seq_length", "samples"):  # matrix 3, D7/D8: raw KeyError, or "20" repeated by `*`
        value = header.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < (2 if field == "seq_length" else 1):
            raise DtmegaError(f"{path} is damaged: {field} = {value!r} is not a {'length' if field == 'seq_length' else 'count'}"
                              f" of at least {2 if field == 'seq_length' else 1}. Fix: preprocess again")
    return header


def sft_tokenizer(prefix: str) -> Tokenizer | None:
    """The tokenizer `<prefix>_sft.json` was made with: the file it names, checked against the
    recorded sha256 (DtmegaError naming the file when it changed or is gone); a header written
    before references embeds the tokenizer itself, which reads too; None if it names none."""
    return tokenizer_from_reference(read_header(prefix).get("tokenizer"), f"{prefix}_sft.json")


def is_sft_data(prefix: str) -> bool:
    """Whether `prefix` names packed chat samples only (its `_sft.json` and no `.idx` of
    pretraining documents): what `dtmega evaluate` reads as SFT data without --sft."""
    return Path(f"{prefix}_sft.json").is_file() and not Path(f"{prefix}.idx").is_file()


@dataclass(frozen=True)
class SFTDataset:
    """`length` samples cycling through samples [first, first + count) of one packed chat file
    (epochs: the run asks for as many as it trains on)."""

    prefix: str
    seq_length: int
    first: int
    count: int
    length: int

    @property
    def _data(self) -> np.ndarray:
        samples = read_header(self.prefix)["samples"]
        return np.memmap(f"{self.prefix}_sft.bin", dtype=np.int32, mode="r", shape=(samples, 3, self.seq_length + 1))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array(self._data[self.first + int(i) % self.count], dtype=np.int64)

    @staticmethod
    def to_fields(samples: np.ndarray) -> TensorDict:
        """[B, 3, S + 1] samples -> tokens, labels, loss mask (the labels' loss flags), positions
        restarting per conversation and document ids ([B, S] each)."""
        data = torch.from_numpy(np.ascontiguousarray(samples))
        tokens, labels = data[:, 0, :-1], data[:, 0, 1:]
        loss_mask = data[:, 1, 1:].float()
        documents = data[:, 2, :-1]
        return make_batch(tokens.contiguous(), labels.contiguous(), loss_mask, positions_from_documents(documents),
                          document_ids=documents.contiguous())


def check_sft_file(prefix: str, seq_length: int, vocab_size: int) -> None:
    """The packed chat file fits this run: its --seq-length, its size, and token ids in the vocabulary."""
    header = read_header(prefix)
    if header["seq_length"] != seq_length:
        raise DtmegaError(f"{prefix}_sft.bin was packed for --seq-length {header['seq_length']}, not {seq_length}. "
                          f"Fix: --seq-length {header['seq_length']}, or preprocess again with --seq-length {seq_length}")
    path = Path(f"{prefix}_sft.bin")
    expected = header["samples"] * 3 * (seq_length + 1) * 4
    if not path.is_file() or path.stat().st_size != expected:
        raise DtmegaError(f"{path} is missing or not the {expected} bytes its header says. Fix: preprocess again")
    data = np.memmap(path, dtype=np.int32, mode="r", shape=(header["samples"], 3, seq_length + 1))
    damaged = f"Fix: preprocess again (dtmega preprocess --chat writes {path.name} and its header together)"
    step = max(1, (64 << 20) // (12 * (seq_length + 1)))  # about 64 MiB of samples per vectorised pass
    top = -1
    for start in range(0, header["samples"], step):
        part = np.asarray(data[start:start + step])
        tokens, flags, documents = part[:, 0], part[:, 1], part[:, 2]
        if (tokens < 0).any():
            raise DtmegaError(f"{path} holds the negative token id {int(tokens.min())}: it is damaged. {damaged}")
        top = max(top, int(tokens.max()))
        odd = (flags != 0) & (flags != 1)
        if odd.any():  # matrix-3 D5: flags 7 and -3 trained a loss of -2502 without a word
            raise DtmegaError(f"{path} holds the loss flag {int(flags[odd][0])} in sample {start + int(odd.any(1).argmax())}"
                              f": each position's flag is 0 (prompt) or 1 (answer), so the file is damaged. {damaged}")
        if (documents[:, 0] != 0).any() or (np.diff(documents, axis=1) < 0).any():
            bad = start + int(((documents[:, 0] != 0) | (np.diff(documents, axis=1) < 0).any(1)).argmax())
            raise DtmegaError(f"{path}: sample {bad}'s conversation ids do not rise from 0 along the sample (each "
                              f"conversation is one run of positions): the file is damaged, or its header does not "
                              f"describe it. {damaged}")
    if top >= vocab_size:
        raise DtmegaError(f"{path} holds token id {top}, but this run's tokenizer has {vocab_size} ids. Fix: the "
                          "tokenizer the chat data was preprocessed with")


def sft_datasets(prefix: str, seq_length: int, split: list[float], wanted: dict[str, int]) -> dict[str, SFTDataset | None]:
    """train/valid(/test) splits of one packed chat file by --split's weights (None where a split
    gets no sample or none is wanted); DtmegaError naming the fix when its --seq-length differs."""
    header = read_header(prefix)
    if header["seq_length"] != seq_length:
        raise DtmegaError(f"{prefix}_sft.bin was packed for --seq-length {header['seq_length']}, not {seq_length}")
    total, weights = header["samples"], [w / sum(split) for w in split]
    bounds = [0]
    for weight in weights:
        bounds.append(min(total, bounds[-1] + round(weight * total)))
    bounds[-1] = total
    out: dict[str, SFTDataset | None] = {}
    for index, name in enumerate(("train", "valid", "test")):
        count = bounds[index + 1] - bounds[index]
        needed = wanted.get(name, 0)
        out[name] = SFTDataset(prefix, seq_length, bounds[index], count, max(count, needed)) if count > 0 and needed \
            else None
    return out
