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
- `${REPEAT}` (the CI's repetition number, used as a --seed): 1, its first run.
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
# Megatron's CI runs a configuration N times with ${REPEAT} = 1..N (a --seed): the first run's value
CI_REPEAT = "1"


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
    """The smallest world Megatron accepts for the configuration's sizes: a multiple of TP x PP x
    CP (the dense layout) and of ETP x EP x PP (the experts' layout) whose data-parallel size is
    a multiple of --num-distributed-optimizer-instances and divides the global batch into
    micro-batches (Megatron's own start-up checks)."""
    tp = _size(model_args.get("--tensor-model-parallel-size"))
    pp = _size(model_args.get("--pipeline-model-parallel-size"))
    cp = _size(model_args.get("--context-parallel-size"))
    ep = _size(model_args.get("--expert-model-parallel-size"))
    etp = _size(model_args.get("--expert-tensor-parallel-size", tp))
    instances = _size(model_args.get("--num-distributed-optimizer-instances"))
    micro = _size(model_args.get("--micro-batch-size"))
    batch = model_args.get("--global-batch-size")
    step = math.lcm(tp * pp * cp, etp * ep * pp)
    for world in range(step, 1024 * step + 1, step):
        dp = world // (tp * pp * cp)
        if dp % instances == 0 and (batch is None or int(batch) % (micro * dp) == 0):
            return world
    return step


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
            argv += [flag, str(value).replace("${REPEAT}", CI_REPEAT)]
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


def refusal_categories(refusal: str) -> list[str]:
    """What refused a configuration, as the docs' table names it: each not-built row the message
    names (docs/training.md, "Not built yet"; a line refused by several rows counts under each), or
    for a start-up check its message's first clause with the numbers as N."""
    import re

    from dtmega.train.not_built import NOT_BUILT

    rows = [item.flags for item in NOT_BUILT if f"{item.flags}: {item.reason}" in refusal]
    if rows:
        return rows
    clause = re.split(r"(?<=[a-z)])[.:;] ", refusal, maxsplit=1)[0]
    return ["check: " + re.sub(r"\d+", "N", clause)[:110]]


def summarize(verdicts: list[Verdict]) -> tuple[int, list[tuple[str, int]]]:
    """(configurations accepted, [(refusal category, configurations)] most first)."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for item in verdicts:
        if item.refusal is not None:
            counts.update(refusal_categories(item.refusal))
    return sum(item.refusal is None for item in verdicts), sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def docs_table(commit: str, total: int, accepted: int, categories: list[tuple[str, int]]) -> str:
    """The markdown docs/training.md holds between its functional-tests markers."""
    lines = [f"Megatron-LM {commit[:10]}: **{accepted} of {total}** configurations pass `dtmega train --dry-run` "
             f"({100 * accepted / total:.1f} %).", "", "| refused by | configurations |", "|---|---|"]
    for category, count in categories:
        name = category.removeprefix("check: ")
        cell = f"start-up check: {name}" if category.startswith("check: ") else f"not built: `{name}`"
        lines.append(f"| {cell.replace('|', chr(92) + '|')} | {count} |")
    return "\n".join(lines)
