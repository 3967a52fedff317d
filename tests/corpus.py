"""Small synthetic JSONL corpora for the data and training tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the lord said unto moses and aaron go forth into the land which i shall give "
         "thee light darkness water earth heaven day night").split()


def make_texts(documents: int, seed: int = 0, words: tuple[int, int] = (5, 60)) -> list[str]:
    """Documents of random words from a small vocabulary (learnable, with repetition)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))).capitalize() + "." for _ in range(documents)]


def write_jsonl(path: Path, texts: list[str], key: str = "text", extra: dict | None = None) -> Path:
    """One JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for i, text in enumerate(texts):
            out.write(json.dumps({key: text, "id": i, **(extra or {})}) + "\n")
    return path
