"""A tokenizer's chat template, rendered with Jinja as transformers renders it.

A Hugging Face tokenizer directory keeps its template in `tokenizer_config.json`
(`chat_template`: a string, or a list of named templates whose "default" is used) or beside it
in `chat_template.jinja`; `dtmega serve --chat-template` and `dtmega preprocess --chat` also take
a .jinja file. Rendering uses
the environment transformers' `apply_chat_template` uses (a sandboxed, immutable Jinja
environment with trim_blocks and lstrip_blocks, loop controls, its `tojson` filter and the
`raise_exception` and `strftime_now` globals), the messages, `add_generation_prompt` and the
tokenizer's special tokens, so the prompt text is the one transformers would build
(tests/unit/test_serve_chat.py compares the two).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dtmega.kernels.errors import DtmegaError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(DtmegaError):
    """A template that cannot be read or rendered; the message names the fix."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json writes it
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens it may refer to."""

    template: str
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> "ChatTemplate":
        """From a tokenizer directory, a tokenizer_config.json or a .jinja file."""
        path = Path(path)
        config: dict = {}
        if path.is_dir():
            config_file = path / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
            jinja = path / "chat_template.jinja"
            template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        elif path.suffix == ".json" and path.is_file():
            config = json.loads(path.read_text())
            template = config.get("chat_template")
        elif path.is_file():
            template = path.read_text()
            beside = path.parent / "tokenizer_config.json"  # its special tokens, where the tokenizer keeps them
            config = json.loads(beside.read_text()) if beside.is_file() else {}
        else:
            raise ChatTemplateError(f"--chat-template {path}: no such file or directory. Fix: a Hugging Face tokenizer "
                                    "directory, its tokenizer_config.json, or a .jinja file")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if not isinstance(template, str) or not template.strip():
            raise ChatTemplateError(f"{path} holds no chat template (tokenizer_config.json's chat_template or "
                                    "chat_template.jinja). Fix: a tokenizer made for chat, or --chat-template FILE.jinja")
        tokens = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
        chat = cls(template, str(path), tokens)
        chat._compiled()  # a template that does not parse fails here, at start-up
        return chat

    def _compiled(self):
        try:
            return _environment().from_string(self.template)
        except Exception as error:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(f"the chat template of {self.source} does not parse: {error}. Fix: a valid Jinja "
                                    "template") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opening."""
        try:
            return self._compiled().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **self.special_tokens)
        except ChatTemplateError:
            raise
        except Exception as error:  # the template's raise_exception, undefined variables, ...
            raise ChatTemplateError(f"the chat template cannot render these messages: {error}") from None


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
