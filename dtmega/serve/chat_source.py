"""Which chat template `dtmega serve` and `dtmega generate --chat` render conversations with, and
the one line that says so at start-up.

In order: `--chat-template` (a tokenizer directory, its tokenizer_config.json or a .jinja file);
else the model's own: the tokenizer files a checkpoint keeps (its state's `hf_files`, which a run
fine-tuned from a Hugging Face model with that model's tokenizer keeps: chat_template.jinja,
tokenizer_config.json, special_tokens_map.json), or with `--load-hf` the directory's; else none.
The special tokens (eos_token: the end of a turn, bos_token, ...) come from the same files as the
template, so a template never renders or stops with another tokenizer's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtmega.data.chat_template import ChatTemplate, ChatTemplateError
from dtmega.train.checkpoint import STATE
from dtmega.train.restore import CheckpointHead


@dataclass(frozen=True)
class ChatChoice:
    """The template in use (None: none at all) and a line naming where it comes from."""

    template: ChatTemplate | None
    note: str


def own_chat_template(head: CheckpointHead) -> ChatTemplate | None:
    """The template the model's own tokenizer files hold (module docstring), None without one.
    A template there that does not parse is a ChatTemplateError naming --chat-template as the fix."""
    files = head.state.get("hf_files") or {}
    if not isinstance(files, dict):
        return None
    name = "chat_template.jinja" if "chat_template.jinja" in files else "tokenizer_config.json"
    kept = (head.checkpoint / STATE).is_file()  # a dtmega checkpoint; else a --load-hf directory
    source = (f"the checkpoint's own ({name} kept in {head.checkpoint / STATE})" if kept else
              str(head.checkpoint / name))
    try:
        return ChatTemplate.from_files({k: v for k, v in files.items() if isinstance(v, str)}, source)
    except ChatTemplateError as error:
        raise ChatTemplateError(f"{error}; or give another with --chat-template DIR|FILE.jinja") from None


def choose_chat_template(override: str | None, head: CheckpointHead) -> ChatChoice:
    """`override` (--chat-template) when given, else the model's own template, else none; each
    read and parsed now, before any weight (a template that does not parse fails at start-up)."""
    if override is not None:
        chat = ChatTemplate.load(override)
        return ChatChoice(chat, f"chat template: --chat-template {override}")
    chat = own_chat_template(head)
    if chat is None:
        return ChatChoice(None, f"chat template: none ({head.checkpoint} keeps no chat template; --chat-template "
                                "DIR|FILE.jinja gives one)")
    return ChatChoice(chat, f"chat template: {chat.source} (--chat-template overrides it)")
