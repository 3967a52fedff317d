"""The conversation `dtmega generate --chat` answers, from its flags.

`--messages FILE`: a JSON list of {"role": ..., "content": ...} (or an object holding it under
"messages": an OpenAI request body, a line of `preprocess --chat`'s JSONL). `--message ROLE:TEXT`
(repeatable): one message each, after the file's, in order. ROLE is always written (system,
developer, user, assistant or tool); the text is everything after the first colon, verbatim, so a
text may hold colons and `--message user:` is an empty user turn. A value without a known role
before its first colon is refused rather than guessed. Messages are checked as the server checks
a chat request's (chat_api.check_messages).
"""

from __future__ import annotations

import json
from pathlib import Path

from dtmega.kernels.errors import DtmegaError
from dtmega.serve.chat_api import ROLES, check_messages
from dtmega.serve.openai_api import CompletionError


class ChatMessagesError(DtmegaError):
    """A --message or --messages that is not a conversation; the message names the fix."""


def parse_message(value: str) -> dict:
    """`ROLE:TEXT` -> {"role": ROLE, "content": TEXT} (module docstring)."""
    role, colon, text = value.partition(":")
    if not colon or role not in ROLES:
        raise ChatMessagesError(f"--message {value!r} does not start with a role. Fix: --message ROLE:TEXT with ROLE "
                                f"one of {', '.join(ROLES)}, e.g. --message 'user:{value}'")
    return {"role": role, "content": text}


def read_messages_file(path: str) -> list:
    """The messages of a --messages file (a JSON list, or an object with "messages")."""
    file = Path(path)
    if not file.is_file():
        raise ChatMessagesError(f"--messages {path}: no such file. Fix: a JSON file holding a list of "
                                "{\"role\": ..., \"content\": ...}")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ChatMessagesError(f"--messages {path} is not JSON ({error}). Fix: a JSON list of "
                                "{\"role\": ..., \"content\": ...}") from None
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list):
        raise ChatMessagesError(f"--messages {path} holds a JSON {type(value).__name__}, not a list of messages. Fix: "
                                "[{\"role\": \"user\", \"content\": ...}, ...] (or {\"messages\": [...]})")
    return value


def chat_messages(messages_file: str | None, messages: list[str]) -> list[dict]:
    """The conversation: the file's messages, then each --message; ChatMessagesError naming the
    fix for an empty or malformed one."""
    conversation = read_messages_file(messages_file) if messages_file else []
    conversation = conversation + [parse_message(value) for value in messages]
    if not conversation:
        raise ChatMessagesError("--chat needs a conversation. Fix: --message user:TEXT (repeatable) or --messages "
                                "FILE.json")
    try:
        return check_messages(conversation)
    except CompletionError as error:
        where = f"--messages {messages_file}" if messages_file else "--message"
        raise ChatMessagesError(f"{where}: {error}") from None
