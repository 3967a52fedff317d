"""LAMBADA last-word accuracy (`dtmega evaluate --task lambada --valid-data lambada_test.jsonl
[--strict-lambada]`), as Megatron's `tasks/zeroshot_gpt` scores it.

Each line of the file is a JSON object with a "text" passage. The model reads the passage
without its end and must predict the end greedily (every target token the argmax of its
position's logits):

- default: the end is the passage's last *token*;
- `--strict-lambada`: the end is the whole last *word* (the text after the last whitespace,
  tokenized with its leading space), and the context is the text before it, stripped. A word
  split into several tokens counts only if every one of them is predicted.

accuracy = correct passages / passages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dtmega.kernels.errors import DtmegaError, MissingInput


@dataclass(frozen=True)
class Example:
    """One passage: context token ids and the target ids that must all be predicted."""

    context: list[int]
    targets: list[int]


@dataclass
class LambadaResult:
    """Correct passages out of all, and whether the strict (whole word) rule was used."""

    correct: int
    total: int
    strict: bool

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)


def split_passage(text: str, tokenizer, strict: bool) -> Example:
    """The context and targets of one passage (module docstring)."""
    if not strict:
        ids = tokenizer.encode(text)
        return Example(ids[:-1], ids[-1:])
    last_word = text.split()[-1]
    start = text.rfind(last_word)
    return Example(tokenizer.encode(text[:start].strip()), tokenizer.encode(" " + last_word))


def read_examples(path: str | Path, tokenizer, strict: bool, max_tokens: int) -> list[Example]:
    """Every passage of a LAMBADA JSONL file, checked: a line that is not a JSON object with a
    non-empty "text", a passage too short to have a context, or one longer than the model's
    context is named with its line number."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"--valid-data {path} does not exist. Fix: the path of a LAMBADA JSONL file "
                                "(one {\"text\": ...} per line)")
    examples = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise DtmegaError(f"{path}:{number} is not a JSON line ({error}). Fix: one JSON object per line, "
                                 "{\"text\": \"...\"}") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise DtmegaError(f"{path}:{number} has no non-empty \"text\" field. Fix: one {{\"text\": \"...\"}} "
                                 "per line")
            example = split_passage(text, tokenizer, strict)
            if not example.context or not example.targets:
                raise DtmegaError(f"{path}:{number}: the passage is too short to have a context before its last "
                                 f"{'word' if strict else 'token'}")
            if len(example.context) + len(example.targets) - 1 > max_tokens:
                raise DtmegaError(f"{path}:{number}: the passage has {len(example.context) + len(example.targets)} "
                                 f"tokens, more than the model's context of {max_tokens}. Fix: shorter passages")
            examples.append(example)
    if not examples:
        raise DtmegaError(f"{path} holds no passages. Fix: one {{\"text\": \"...\"}} per line")
    return examples
