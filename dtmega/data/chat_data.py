"""Chat (SFT) data: JSONL conversations rendered with the tokenizer's chat template, loss on the
assistant's tokens only, packed into samples of --seq-length + 1 tokens with their boundaries.

    dtmega preprocess --chat --input chats.jsonl --output-prefix data/chat --tokenizer-type HuggingFaceTokenizer \\
        --tokenizer-model HF_DIR --seq-length 2048 [--chat-overlong truncate|drop] [--chat-template FILE]

Each line is `{"messages": [{"role": ..., "content": ...}, ...]}` (roles system, developer, user,
assistant, tool; content a string). A conversation is rendered turn by turn: for each assistant
message, the template's text up to its turn (`add_generation_prompt`) and the text of its answer
(through the template's end of turn) are tokenized as their own segments, the answer's tokens
marked for the loss. So the loss counts exactly the tokens the model should produce, its
end-of-turn token included, and never a prompt token. A template whose rendering of a
conversation's start is not the start of its rendering of the whole is refused (nothing to cut).

Conversations are packed whole, best fit by decreasing length, into samples of S + 1 tokens; the
rest of a sample is end-of-document padding outside the loss. A conversation longer than S + 1
tokens is cut there (`truncate`, the default) or left out (`drop`); both are counted. Every
sample records its conversations' boundaries, which `dtmega train --sft` hands to document
masking (attention within each conversation, positions restarting at each).

The output is `<prefix>_sft.bin` (N x 3 x (S + 1) int32: tokens, loss flags, conversation ids)
and `<prefix>_sft.json` (format, sizes, counts, template, and the tokenizer by reference: its
file's path and sha256, dtmega/data/tokenizer_reference.py); dtmega/data/sft_dataset.py reads it.
Bad input is one error naming the line and the fix, before anything is written.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dtmega.data.chat_template import ChatTemplate, ChatTemplateError
from dtmega.data.tokenizer_reference import tokenizer_reference
from dtmega.kernels.errors import DtmegaError
from dtmega.safe_files import create_exclusive, replace_from_temporary
from dtmega.writable import make_writable_dir

ROLES = ("system", "developer", "user", "assistant", "tool")
FORMAT = "dtmega-sft-v1"
OVERLONG = ("truncate", "drop")


class ChatDataError(DtmegaError):
    """A chat file or template that cannot be used; the message names the line and the fix."""


@dataclass
class ChatCounts:
    """What preprocessing did with the conversations."""

    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    without_answer: int = 0
    assistant_tokens: int = 0
    samples: int = 0
    tokens: list[int] = field(default_factory=list)  # kept conversations' lengths


def read_conversations(path: Path) -> list[tuple[int, list[dict]]]:
    """(line number, messages) of every non-empty line; ChatDataError naming the line otherwise."""
    out = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ChatDataError(f"{where}: not JSON ({error}). Fix: one {{\"messages\": [...]}} object per line") \
                    from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                raise ChatDataError(f"{where}: no \"messages\" list. Fix: {{\"messages\": [{{\"role\": \"user\", "
                                    "\"content\": ...}, ...]}")
            for index, message in enumerate(messages):
                if not isinstance(message, dict) or "role" not in message:
                    raise ChatDataError(f"{where}: message {index} has no role. Fix: give each message a \"role\" "
                                        f"({', '.join(ROLES)})")
                if message["role"] not in ROLES:
                    raise ChatDataError(f"{where}: message {index} has the unknown role {message['role']!r}. Fix: one "
                                        f"of {', '.join(ROLES)}")
                if not isinstance(message.get("content"), str):
                    raise ChatDataError(f"{where}: message {index}'s content is {type(message.get('content')).__name__}"
                                        ", not a string. Fix: the message's text as a string")
                try:  # matrix 3, D9: a lone surrogate was the tokenizer's raw TypeError, no line named
                    message["content"].encode("utf-8")
                except UnicodeEncodeError as error:
                    raise ChatDataError(f"{where}: message {index} holds the lone surrogate "
                                        f"{message['content'][error.start]!r} at character {error.start}, which is not "
                                        "text. Fix: the line's text as valid UTF-8") from None
            out.append((number, [{"role": m["role"], "content": m["content"]} for m in messages]))
    if not out:
        raise ChatDataError(f"{path} holds no conversations")
    return out


def conversation_tokens(messages: list[dict], chat: ChatTemplate, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(token ids, loss flags) of one conversation: the assistant's answers flagged 1."""
    ids: list[int] = []
    flags: list[int] = []
    done = ""

    def render(upto: int, generation: bool) -> str:
        try:
            return chat.render(messages[:upto], add_generation_prompt=generation)
        except ChatTemplateError as error:
            fix = "" if "Fix:" in str(error) else ". Fix: messages the template accepts"
            raise ChatDataError(f"{where}: {error}{fix}") from None

    def add(text: str, flag: int) -> None:
        piece = tokenizer.encode(text) if text else []
        ids.extend(piece)
        flags.extend([flag] * len(piece))

    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, answered = render(index, True), render(index + 1, False)
        if not prompt.startswith(done) or not answered.startswith(prompt):
            raise ChatDataError(f"{where}: the chat template renders message {index}'s turn differently from the "
                                "conversation's start, so the answer cannot be cut out. Fix: a template whose "
                                "rendering of a conversation's beginning is the beginning of its rendering")
        add(prompt[len(done):], 0)
        add(answered[len(prompt):], 1)
        done = answered
    whole = render(len(messages), False)
    add(whole[len(done):] if whole.startswith(done) else "", 0)
    return ids, flags


PADDED_FILE_BYTES = 256 << 20  # past this size a file that is over 90 % padding is refused


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: conversation indices per sample, each sample's total <= capacity.
    The samples' (room left, sample) pairs are kept sorted, so the best fit (the least room that
    holds the conversation, the first such sample on a tie) is one bisection, not a scan of every
    sample (matrix 3, C13: quadratic in the samples)."""
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room, sample)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(rooms, (lengths[index], -1))
        if at == len(rooms):
            bins.append([index])
            bisect.insort(rooms, (capacity - lengths[index], len(bins) - 1))
        else:
            room, sample = rooms.pop(at)
            bins[sample].append(index)
            bisect.insort(rooms, (room - lengths[index], sample))
    return bins


def preprocess_chat(input_path: Path, output_prefix: str, tokenizer, chat: ChatTemplate, seq_length: int,
                    overlong: str = "truncate", tokenizer_source: str | Path | None = None) -> ChatCounts:
    """Renders, tokenizes, packs and writes `<prefix>_sft.bin/.json` (module docstring).
    `tokenizer_source` (--tokenizer-model) is recorded by reference: path and sha256."""
    if overlong not in OVERLONG:
        raise ChatDataError(f"--chat-overlong {overlong!r}; use one of {', '.join(OVERLONG)}")
    if seq_length < 2:
        raise ChatDataError(f"--seq-length {seq_length} must be at least 2")
    try:  # before any conversation is rendered (matrix 3, D10: a raw error after all the work)
        make_writable_dir(Path(output_prefix).parent)
    except OSError as error:
        raise ChatDataError(f"--output-prefix {output_prefix}: cannot write there ({error.strerror}: {error.filename}). "
                            "Fix: an output prefix in a writable directory") from None
    capacity = seq_length + 1
    counts = ChatCounts()
    kept: list[tuple[list[int], list[int]]] = []
    for number, messages in read_conversations(Path(input_path)):
        counts.conversations += 1
        ids, flags = conversation_tokens(messages, chat, tokenizer, f"{input_path}:{number}")
        if len(ids) > capacity:
            if overlong == "drop":
                counts.dropped += 1
                continue
            ids, flags = ids[:capacity], flags[:capacity]
            counts.truncated += 1
        if not any(flags[1:]):  # nothing to learn (the first token is never a label)
            counts.without_answer += 1
            continue
        kept.append((ids, flags))
    reference = tokenizer_reference(tokenizer_source, tokenizer) if tokenizer_source is not None else None
    if not kept:
        raise ChatDataError(f"{input_path}: no conversation with an assistant answer fits (conversations "
                            f"{counts.conversations}, dropped {counts.dropped}). Fix: a longer --seq-length, or "
                            "--chat-overlong truncate")
    counts.tokens = [len(ids) for ids, _ in kept]
    bins = pack(counts.tokens, capacity)
    positions, tokens = len(bins) * capacity, sum(counts.tokens)
    if positions * 12 > PADDED_FILE_BYTES and tokens < positions // 10:  # matrix 3, D11
        raise ChatDataError(f"{len(bins):,} samples of {capacity:,} positions would hold {tokens:,} tokens: "
                            f"{100 * (1 - tokens / positions):.2f} % padding in a {positions * 12 / 2**30:,.1f} GiB file. "
                            "Fix: the training run's --seq-length (a sample is one training sequence)")
    data = np.zeros((len(bins), 3, capacity), dtype=np.int32)
    for sample, members in enumerate(bins):
        at = 0
        for document, index in enumerate(members):
            ids, flags = kept[index]
            data[sample, 0, at:at + len(ids)] = ids
            data[sample, 1, at:at + len(ids)] = flags
            data[sample, 2, at:at + len(ids)] = document
            at += len(ids)
        data[sample, 0, at:] = tokenizer.eod  # padding: its own document, outside the loss
        data[sample, 2, at:] = len(members)
    counts.samples = len(bins)
    counts.assistant_tokens = int(data[:, 1, 1:].sum())  # the loss's targets: flags of positions 1..S
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(f"{prefix}_sft.bin.tmp")
    try:
        with create_exclusive(temporary) as handle:  # never written through a planted link
            data.tofile(handle)
    except OSError as error:  # matrix 3, D13: a full disk left the temporary and a raw traceback
        temporary.unlink(missing_ok=True)
        # numpy's tofile says only "N requested and M written" (no errno): a short write is a full disk
        reason = error.strerror or (os.strerror(error.errno) if error.errno else
                                    f"the disk took only part of the file ({error}): no space left on device")
        raise ChatDataError(f"--output-prefix {output_prefix}: {reason} while writing {temporary.name}; it was "
                            "removed and nothing else was touched. Fix: free space there, or another "
                            "--output-prefix") from None
    temporary.replace(f"{prefix}_sft.bin")
    header = {"format": FORMAT, "seq_length": seq_length, "samples": counts.samples,
              "conversations": counts.conversations, "truncated": counts.truncated, "dropped": counts.dropped,
              "without_answer": counts.without_answer, "assistant_tokens": counts.assistant_tokens,
              "eod": int(tokenizer.eod), "chat_template": chat.source, "tokenizer": reference}
    replace_from_temporary(Path(f"{prefix}_sft.json"), json.dumps(header, indent=1))
    return counts
