"""Megatron-LM's own functional-test configurations as `dtmega train --dry-run` lines (issue 51,
item 5): each configuration's `MODEL_ARGS` (copied in tests/data/megatron_functional_model_args.json
by tests/scripts/copy_megatron_functional_args.py, with the Megatron-LM commit) with its data,
tokenizer and checkpoint paths swapped for `--mock-data` and scratch directories, on the world its
parallel sizes imply. `verdict` says whether dtmega accepts the line and, when not, why.

What is swapped, and why each swap keeps the configuration's model and plan:
- `--data-path`, `--split`, `--data-cache-path`, `--fim-*`: the data, replaced by `--mock-data`.
- `--vocab-file`/`--merge-file` (GPT-2 BPE), `--tokenizer-model` and `--tokenizer-type`: files on
  Megatron's CI machines; replaced by `--tokenizer-type NullTokenizer --vocab-size N` with N the
  tokenizer's own vocabulary (50,257 for GPT-2's BPE; the TikTokenizer's ranks; 256,000 for the
  Nemotron SentencePiece models these configs name), so the padded vocabulary is Megatron's.
- `--load`, `--save`, `--tensorboard-dir`, `--wandb-save-dir`, `--output-path`, `--prompt-file` and
  checkpoint-export paths: empty scratch directories under the test's directory; `--load` and
  `--save` share one, Megatron's restart idiom (the first run starts fresh, a restart resumes), as
  its CI's first run of a resume test does. A line with `--load` and no `--save` (the inference
  configurations) needs a checkpoint that the scratch directory does not hold, and dtmega says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "megatron_functional_model_args.json"

DATA_FLAGS = ("--data-path", "--split", "--data-cache-path", "--fim-data", "--per-split-data-args-path",
              "--train-data-path", "--valid-data-path", "--test-data-path", "--mock-data")
TOKENIZER_FLAGS = ("--vocab-file", "--merge-file", "--tokenizer-model", "--tokenizer-type", "--tiktoken-pattern",
                   "--vocab-size")
SCRATCH_FLAGS = ("--load", "--save", "--tensorboard-dir", "--wandb-save-dir", "--output-path", "--prompt-file",
                 "--export-kd-teacher-load", "--pretrained-checkpoint", "--langrl-env-config", "--data-args-path")
# The vocabulary of each tokenizer these configurations name (Megatron's CI files).
GPT2_BPE_VOCAB = 50257
TIKTOKEN_VOCAB = 131072
SENTENCEPIECE_VOCAB = 256000


@dataclass(frozen=True)
class Verdict:
    """One configuration's outcome: the dtmega line, its world, and the refusal (None: accepted)."""

    name: str
    world: int
    argv: tuple[str, ...]
    refusal: str | None


def configurations() -> tuple[str, dict[str, dict]]:
    """(Megatron-LM commit, {"<family>/<case>": MODEL_ARGS}) from the copy in tests/data."""
    copied = json.loads(DATA.read_text())
    return copied["commit"], copied["configs"]


def _size(value) -> int:
    return int(value) if value not in (None, "") else 1


def implied_world(model_args: dict) -> int:
    """The smallest world Megatron accepts for the configuration's parallel sizes: a multiple of
    TP x PP x CP (the dense layout) and of ETP x EP x PP (the experts' layout)."""
    tp = _size(model_args.get("--tensor-model-parallel-size"))
    pp = _size(model_args.get("--pipeline-model-parallel-size"))
    cp = _size(model_args.get("--context-parallel-size"))
    ep = _size(model_args.get("--expert-model-parallel-size"))
    etp = _size(model_args.get("--expert-tensor-parallel-size", tp))
    return math.lcm(tp * pp * cp, etp * ep * pp)


def _vocab_of(model_args: dict) -> int:
    kind = str(model_args.get("--tokenizer-type", "GPT2BPETokenizer"))
    if "--vocab-size" in model_args:
        return int(model_args["--vocab-size"])
    if kind == "TikTokenizer":
        return TIKTOKEN_VOCAB
    if kind in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"):
        return SENTENCEPIECE_VOCAB
    return GPT2_BPE_VOCAB


def dtmega_line(model_args: dict, scratch: Path) -> list[str]:
    """The configuration's flags as a `dtmega train` line with the swaps this module's docstring
    lists. YAML true is the bare flag, false and null are left out, lists are repeated values."""
    argv: list[str] = []
    for flag, value in model_args.items():
        if flag in DATA_FLAGS or flag in TOKENIZER_FLAGS or flag.startswith("--fim-"):
            continue
        if flag in SCRATCH_FLAGS:  # an empty directory: nothing to resume, somewhere to write
            # --load and --save share one (Megatron's restart idiom: the first run starts fresh)
            path = scratch / ("checkpoints" if flag in ("--load", "--save") else flag.strip("-"))
            path.mkdir(parents=True, exist_ok=True)
            argv += [flag, str(path)]
        elif value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(_vocab_of(model_args))]
    return argv


def verdict(name: str, model_args: dict, scratch: Path) -> Verdict:
    """Runs `dtmega train <line> --dry-run <world>` in this process and returns its outcome: an
    input error (dtmega's DtmegaError, one line naming the fix) is a refusal; anything else raised
    is a bug and propagates."""
    from dtmega.kernels.errors import DtmegaError
    from dtmega.train.args import parse_train_args
    from dtmega.train.prepare import dry_run

    world = implied_world(model_args)
    argv = [*dtmega_line(model_args, scratch), "--dry-run", str(world)]
    try:
        args, notes = parse_train_args(argv)
        dry_run(args, notes)
    except DtmegaError as error:
        return Verdict(name, world, tuple(argv), str(error))
    return Verdict(name, world, tuple(argv), None)
