"""A tokenizer's chat template, rendered with Jinja as transformers renders it.

A Hugging Face tokenizer directory keeps its template in `tokenizer_config.json`
(`chat_template`: a string, or a list of named templates whose "default" is used) or beside it
in `chat_template.jinja`, and its special tokens in `tokenizer_config.json` (or
`special_tokens_map.json`); `dtmega serve --chat-template` and `dtmega preprocess --chat` also take
a .jinja file. A checkpoint fine-tuned from a Hugging Face model keeps those files (its
`hf_files`), and `ChatTemplate.from_files` reads them there (dtmega/serve/chat_source.py). Rendering uses the
environment transformers' `apply_chat_template` uses (a sandboxed, immutable Jinja
environment with trim_blocks and lstrip_blocks, loop controls, its `tojson` filter and the
`raise_exception` and `strftime_now` globals), the messages, `add_generation_prompt` and the
tokenizer's special tokens, so the prompt text is the one transformers would build
(tests/unit/test_serve_chat.py compares the two).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dtmega.kernels.errors import DtmegaError
from dtmega.safe_files import read_regular_text

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json")  # what a template reads


class ChatTemplateError(DtmegaError):
    """A template that cannot be read or rendered; the message names the fix."""


def _read(path: Path) -> str:
    """A template file's text: a regular file of at most 64 MiB (a FIFO or a device is refused)."""
    return read_regular_text(path, "the chat template file")


def _json_object(text: str | None, what: str) -> dict:
    """A JSON object file's content ({} for a file that is absent); ChatTemplateError otherwise."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ChatTemplateError(f"{what} is not JSON ({error}). Fix: the file as the tokenizer saved it") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{what} is not a JSON object. Fix: the file as the tokenizer saved it")
    return value


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
        """From a tokenizer directory, a tokenizer_config.json or a .jinja file (`--chat-template`,
        `preprocess --chat`); ChatTemplateError naming the fix when there is none or it does not parse."""
        path = Path(path)
        if path.is_dir():
            files = {name: _read(path / name) for name in TEMPLATE_FILES if (path / name).exists()}
        elif path.suffix == ".json" and path.exists():
            files = {"tokenizer_config.json": _read(path)}
        elif path.exists():  # a .jinja file, with the special tokens of the tokenizer files beside it
            files = {name: _read(path.parent / name) for name in TEMPLATE_FILES[1:] if (path.parent / name).exists()}
            files["chat_template.jinja"] = _read(path)
        else:
            raise ChatTemplateError(f"--chat-template {path}: no such file or directory. Fix: a Hugging Face tokenizer "
                                    "directory, its tokenizer_config.json, or a .jinja file")
        chat = cls.from_files(files, str(path))
        if chat is None:
            raise ChatTemplateError(f"{path} holds no chat template (tokenizer_config.json's chat_template or "
                                    "chat_template.jinja). Fix: a tokenizer made for chat, or --chat-template FILE.jinja")
        return chat

    @classmethod
    def from_files(cls, files: dict[str, str], source: str) -> "ChatTemplate | None":
        """From a tokenizer's files as text ({name: text}: a directory's, or the `hf_files` a
        checkpoint keeps): `chat_template.jinja`, else tokenizer_config.json's `chat_template`
        (a string, or named templates whose "default" is used); None when neither holds one. The
        special tokens come from tokenizer_config.json, those it lacks from special_tokens_map.json
        (transformers' order for a tokenizer_config.json that lists its added tokens)."""
        config = _json_object(files.get("tokenizer_config.json"), f"{source}: tokenizer_config.json")
        tokens_map = _json_object(files.get("special_tokens_map.json"), f"{source}: special_tokens_map.json")
        template = files["chat_template.jinja"] if "chat_template.jinja" in files else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if not isinstance(template, str) or not template.strip():
            return None
        tokens = {}
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name))
            text = text if text is not None else _token_text(tokens_map.get(name))
            if text is not None:
                tokens[name] = text
        chat = cls(template, source, tokens)
        chat._compiled()  # a template that does not parse fails here, at start-up
        return chat

    def _compiled(self):
        try:
            return _compile(self.template)
        except Exception as error:  # jinja2.TemplateSyntaxError and friends
            raise ChatTemplateError(f"the chat template of {self.source} does not parse: {error}. Fix: a valid Jinja "
                                    "template") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opening. A render is
        bounded (matrix 3, C1/C2: nested loops or `10**(10**10)` hung preprocess and the server):
        at most RENDER_SECONDS of template code, powers and repetitions of bounded size, and at
        most RENDER_CHARS of output; past any, a ChatTemplateError naming the template."""
        compiled = self._compiled()
        deadline = time.monotonic() + RENDER_SECONDS
        previous = sys.gettrace()

        def budget(frame, event, arg):  # called on the template code's lines: a loop cannot outrun it
            if time.monotonic() > deadline:
                raise _RenderBudget(f"did not finish rendering within {RENDER_SECONDS:g} s")
            return budget

        sys.settrace(budget)
        try:
            text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except _RenderBudget as error:
            raise ChatTemplateError(f"the chat template of {self.source} {error}. Fix: a template without unbounded "
                                    "loops or arithmetic (the model's own tokenizer_config.json)") from None
        except ChatTemplateError:
            raise
        except Exception as error:  # the template's raise_exception, undefined variables, ...
            raise ChatTemplateError(f"the chat template cannot render these messages: {error}") from None
        finally:
            sys.settrace(previous)
        if len(text) > RENDER_CHARS:
            raise ChatTemplateError(f"the chat template of {self.source} rendered {len(text):,} characters, more than "
                                    f"the {RENDER_CHARS:,} a prompt may hold. Fix: shorter messages, or the model's own "
                                    "template")
        return text


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    if isinstance(indent, int) and indent > MAX_INDENT:  # matrix 3, C4: indent 10^9 built gigabytes in C
        raise _RenderBudget(f"asks tojson for an indent of {indent}, more than {MAX_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


MAX_INDENT = 64  # tojson's indent: templates use 2 or 4
RENDER_SECONDS = 10.0
RENDER_CHARS = 64 << 20  # characters of one rendered prompt
MAX_OPERAND_BITS = 1 << 16  # a power's or repetition's result: at most this many bits or items


class _RenderBudget(Exception):
    """A render past its budget (caught by `ChatTemplate.render`)."""


def _bounded_binop(env, context, operator: str, left, right):
    """`**` and `*` of the template's code with their results bounded before they are computed
    (a single `10**(10**10)` runs in C, out of the time budget's reach)."""
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
            and max(1, abs(left).bit_length()) * right > MAX_OPERAND_BITS:
        raise _RenderBudget(f"computes {left}**{right}, a number of more than {MAX_OPERAND_BITS} bits")
    if operator == "*" and isinstance(right, int) and hasattr(left, "__len__") and len(left) * right > RENDER_CHARS \
            or operator == "*" and isinstance(left, int) and hasattr(right, "__len__") and len(right) * left > RENDER_CHARS:
        raise _RenderBudget(f"repeats a sequence to more than {RENDER_CHARS:,} items")
    return env.binop_table[operator](left, right)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """A template compiled once (matrix 3, C13: it was compiled again at every render, the
    dominant cost of `preprocess --chat` on many short conversations)."""
    return _environment().from_string(template)


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("**", "*"))

        def call_binop(self, context, operator, left, right):
            return _bounded_binop(self, context, operator, left, right)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
