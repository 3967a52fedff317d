"""Model directories are local: dtmega never downloads weights or tokenizers from a hub.

A Hugging Face user's first try is often a Hub id (`--load-hf HuggingFaceTB/SmolLM2-135M-Instruct`);
it used to fail on whichever file was opened first, once naming `--tokenizer-model`, a flag the
user never passed. `require_local_dir` says what happened and how to get the files.
"""

from __future__ import annotations

import re
from pathlib import Path

from dtmega.kernels.errors import MissingInput

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(text: str) -> bool:
    """`org/name` with no leading `/`, `.` or `~`: how the Hub names a model (and how a relative
    path of two parts looks too, so this is only asked of a path that does not exist)."""
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "~"))


def require_local_dir(path: str | Path, flag: str) -> Path:
    """`path` as a directory that exists, or a MissingInput naming the flag and the fix (for a
    Hub id: download it first, then pass the directory)."""
    directory = Path(path)
    if directory.is_dir():
        return directory
    text = str(path)
    if not directory.exists() and looks_like_hub_id(text):
        local = f"models/{text.split('/')[-1]}"
        raise MissingInput(f"{flag} {text} is not a local directory; it looks like a Hugging Face Hub id, and dtmega "
                           "never downloads weights or tokenizers. Fix: download it first (`huggingface-cli download "
                           f"{text} --local-dir {local}`) and pass {flag} {local}")
    what = "is a file, not a directory" if directory.exists() else "does not exist"
    raise MissingInput(f"{flag} {text} {what}. Fix: a Hugging Face model directory (config.json, *.safetensors, "
                       "tokenizer files)")
