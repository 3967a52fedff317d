"""WikiText-style perplexity (`dtmega evaluate --task wikitext --valid-data wiki.test.tokens`),
as Megatron's `tasks/zeroshot_gpt` computes it.

The file is read whole; its word count (the text split at single spaces) is taken before
anything else; WikiText's tokenization artifacts are undone (`detokenize`, below); the text is
tokenized once. Windows of `seq_length` targets start every `overlapping_eval` tokens: the first
window scores all its targets, every later one only its last `overlapping_eval`, so each target
is scored exactly once, with at least `seq_length - overlapping_eval` tokens of context (except
in the first window). Then, with T the number of tokens and W the number of words:

    loss = (sum of the scored targets' losses) / (T - 1)
    perplexity = exp(loss)
    adjusted perplexity = exp(loss * (T - 1) / (W - 1))     (per word: comparable across tokenizers)

(Megatron clamps the exponent at 20; dtmega reports the exact value and says when it is huge.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dtmega.kernels.errors import DtmegaError, MissingInput

# WikiText's tokenized form -> plain text. Each rule joins what the corpus split apart.
_REPLACEMENTS = [
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),                # number and hyphen separators
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
    ("( ", "("), (" )", ")"), ("[ ", "["), (" ]", "]"), ("{ ", "{"), (" }", "}"),
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),          # section heading markers
    (" 's", "'s"), (" n't", "n't"), (" 're", "'re"), (" 've", "'ve"), (" 'll", "'ll"), (" 'd", "'d"), (" 'm", "'m"),
    ("s ' ", "s' "),                                               # plural possessive
    (" \n", "\n"), ("\n ", "\n"),
]
_QUOTED = re.compile(r'" ([^"\n]*?) "')


def detokenize(text: str) -> str:
    """Undoes WikiText's tokenization (" @-@ " -> "-", " , " -> ", ", "( x )" -> "(x)", '" x "'
    -> '"x"', " 's" -> "'s", heading markers "= = =" -> "===", ...)."""
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    return _QUOTED.sub(r'"\1"', text)


def count_words(text: str) -> int:
    """Megatron's original-token count: the raw file split at single spaces."""
    return len(text.strip().split(" "))


@dataclass(frozen=True)
class Window:
    """Tokens [start, start + seq_length] of the text: inputs are all but the last, targets all
    but the first; `scored_from` is the first target index (0-based, within the window) scored."""

    start: int
    scored_from: int


def windows(num_tokens: int, seq_length: int, overlapping_eval: int) -> list[Window]:
    """The windows that score every target once (module docstring); windows that would score
    nothing (past the end) are left out."""
    targets = num_tokens - 1
    stride = max(1, min(overlapping_eval, seq_length))
    out = [Window(0, 0)]
    start = stride
    while start + seq_length - stride < targets:  # this window's scored targets begin inside the text
        out.append(Window(start, seq_length - stride))
        start += stride
    return out


@dataclass
class WikitextResult:
    """Loss per token, its perplexity, and the word-level (adjusted) perplexity."""

    loss: float
    perplexity: float
    adjusted_perplexity: float
    tokens: int
    words: int
    windows: int


def window_batch(tokens: torch.Tensor, window: Window | None, seq_length: int, pad: int) -> tuple:
    """(inputs, labels, loss mask) [seq_length] of one window; None: an all-masked filler row
    (a data-parallel rank past the last window still takes part in the collective)."""
    inputs = torch.full((seq_length,), pad, dtype=torch.long)
    labels = torch.full((seq_length,), pad, dtype=torch.long)
    mask = torch.zeros(seq_length)
    if window is not None:
        piece = tokens[window.start:window.start + seq_length + 1]
        n = len(piece) - 1
        inputs[:n], labels[:n] = piece[:-1], piece[1:]
        mask[window.scored_from:n] = 1.0
    return inputs, labels, mask


def summarize(total_loss: float, num_tokens: int, words: int, num_windows: int) -> WikitextResult:
    """The reported numbers from the summed loss (module docstring's formulas)."""
    loss = total_loss / max(num_tokens - 1, 1)
    ratio = (num_tokens - 1) / max(words - 1, 1)
    return WikitextResult(loss, _exp(loss), _exp(loss * ratio), num_tokens, words, num_windows)


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def read_text(path: str | Path) -> str:
    """The file's text; a clear error if it is missing or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"--valid-data {path} does not exist. Fix: the path of a WikiText file, e.g. "
                                "wikitext-103/wiki.test.tokens")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise DtmegaError(f"--valid-data {path} is not UTF-8 text (byte {error.start}). Fix: a WikiText .tokens or "
                         "plain-text file") from None
