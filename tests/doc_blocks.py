"""The code blocks of README.md and docs/*.md, and how the suite runs them.

Every fenced block in python, bash or toml carries a marker on the line above it (an HTML
comment, invisible when rendered) saying what the suite does with it:

    <!-- doc: run -->                 python: run as a script; bash: run every command
    <!-- doc: run torchrun=4 -->      python: run on 4 ranks (torchrun)
    <!-- doc: excerpt FILE -->        every line of the block appears in FILE, in order
                                       ("..." lines stand for omitted code)
    <!-- doc: skip REASON -->         not run; the reason is listed by the suite

A block without a marker fails the suite, so a new doc block is never silently untested.
Bash commands run in a sandbox directory prepared with a small corpus, its tokenizer and a
tiny checkpoint (`ckpt`), scaled where they name GPUs or big models (`scale_command`):
a `dtmega train` launch for more ranks than this machine has, or for a preset bigger than the
debug models, is checked with `--dry-run WORLD` (the whole plan for WORLD ranks, on the meta
device); launches that fit run for real for a few steps; benchmarks run their smallest sweep.
Consecutive one-process `dtmega` commands of a block (preprocess, dry runs, evaluate, generate)
run in one interpreter through the console script's entry point (tests/dtmega_commands.py):
each new Python start costs ~3 s of imports, and the docs hold dozens of such lines.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_LANGUAGES = ("python", "bash", "sh", "toml")
MARKER = re.compile(r"<!--\s*doc:\s*(run|excerpt|skip)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^\s*```(\w*)\s*$")
LOCAL_RANKS = 4  # the most ranks a command may launch here
SMALL_MODELS = ("debug", "debug-moe")

# What each benchmark's smallest sweep is (the docs show the full command; CI runs this).
BENCHMARK_SCALE = {
    "overhead.py": ["--steps", "2"],
    "preprocess.py": ["--size-mb", "1", "--workers", "1"],
    "train.py": ["--steps", "2", "--max-plans", "1"],
    "pipeline.py": ["--pp", "2", "--microbatches", "4", "--tick", "0.002"],
    "context.py": ["--seq", "256", "--cp", "1", "2", "--methods", "ring", "--steps", "1"],
    "moe.py": ["--ep", "1", "2", "--dispatchers", "alltoall", "--routing", "topk", "--seq", "64", "--steps", "1"],
    "gpu_step.py": ["--tiny", "--in-process", "--systems", "plain", "dtmega+kernels", "--repeats", "2"],
    "gpu_check.py": [],
    "kernels.py": ["--tiny"],
    "fp8_training.py": ["--steps", "4", "--warmup", "1", "--log-interval", "1", "--size", "tiny"],
    "serve.py": ["--clients", "2", "--requests", "1", "--tokens", "2", "--load", "ckpt"],
    "documents.py": ["--seq", "256", "--steps", "1", "--warmup", "0"],
    "document_balance.py": ["--seq", "1024", "--cp", "2", "4", "--samples", "1"],
    "published_runs.py": ["--only", "mb-25.11"],  # the model only; the whole set is tests/unit/test_published_runs.py
}
# A real training launch that fits runs this many steps, evaluating and saving once.
TRAIN_CAPS = ["--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "2", "--eval-iters", "1",
              "--save-interval", "2", "--log-interval", "1"]


@dataclass
class Block:
    """One fenced code block and what the suite does with it."""

    path: Path
    line: int
    language: str
    action: str  # run | excerpt | skip | "" (no marker)
    argument: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def ranks(self) -> int:
        match = re.search(r"torchrun=(\d+)", self.argument)
        return int(match.group(1)) if match else 1


def collect_blocks(paths: list[Path] = DOCS) -> list[Block]:
    """Every fenced block of the given markdown files (prose blocks included, action '')."""
    blocks = []
    for path in paths:
        lines = path.read_text().splitlines()
        index = 0
        while index < len(lines):
            fence = FENCE.match(lines[index])
            if not fence:
                index += 1
                continue
            start, language = index, fence.group(1)
            end = next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("```"))
            marker = MARKER.search(lines[start - 1]) if start else None
            indent = len(lines[start]) - len(lines[start].lstrip())
            code = "\n".join(line[indent:] for line in lines[start + 1:end])
            blocks.append(Block(path, start + 1, language, marker.group(1) if marker else "",
                                marker.group(2) if marker else "", code))
            index = end + 1
    return blocks


def code_blocks() -> list[Block]:
    """The blocks that hold code (python, bash, sh, toml): each must carry a marker."""
    return [block for block in collect_blocks() if block.language in CODE_LANGUAGES]


def commands(code: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        found.append(re.sub(r"\s+#.*$", "", line))
    return found


def excerpt_missing(block: Block) -> str | None:
    """None if every line of the block appears in the named file in order, else the first that
    does not ("..." lines skip any amount of code)."""
    source = (ROOT / block.argument).read_text().splitlines()
    position = 0
    for line in block.code.splitlines():
        wanted = line.strip()
        if not wanted or wanted == "...":
            continue
        while position < len(source) and source[position].strip() != wanted:
            position += 1
        if position == len(source):
            return line
        position += 1
    return None


def _launcher(tokens: list[str]) -> tuple[int, list[str]]:
    """(world size, the command after torchrun's own options) of a `[srun] torchrun ...` line."""
    if tokens and tokens[0] == "srun":
        tokens = tokens[1:]
    if not tokens or tokens[0] != "torchrun":
        return 1, tokens
    nodes, per_node, index = 1, 1, 1
    while index < len(tokens) and tokens[index].startswith("--"):
        option = tokens[index]
        value = tokens[index + 1] if "=" not in option else option.split("=", 1)[1]
        step = 2 if "=" not in option else 1
        if option.startswith("--nnodes"):
            nodes = int(value)
        elif option.startswith("--nproc-per-node") or option.startswith("--nproc_per_node"):
            per_node = int(value)
        index += step
    return nodes * per_node, tokens[index:]


def _option(tokens: list[str], name: str) -> str | None:
    return tokens[tokens.index(name) + 1] if name in tokens and tokens.index(name) + 1 < len(tokens) else None


def scale_command(command: str, python: str, out_dir: Path) -> str:
    """The command line the suite runs for a documented one (see the module docstring)."""
    if command.startswith(("head=", "export ")):
        return "true"  # SLURM host lookup: replaced by the prelude's head=localhost
    tokens = shlex.split(command, posix=True)
    world, rest = _launcher(tokens)
    if rest[:1] == ["dtmega"]:
        rest = ["-m", "dtmega", *rest[1:]]
    if rest[:1] in ([".venv/bin/python"], ["python"], ["python3"]):
        rest = rest[1:]
    if rest[:1] and rest[0].startswith("benchmarks/"):
        script = Path(rest[0]).name
        return shlex.join([python, *rest, *BENCHMARK_SCALE[script], "--out", str(out_dir / f"{script}.json")])
    if rest[:3] == ["-m", "dtmega", "train"]:
        model = _option(rest, "--model")
        if world > LOCAL_RANKS or (model is not None and model not in SMALL_MODELS):
            return shlex.join([python, *rest, "--dry-run", str(world)])
        rest = [*rest, *TRAIN_CAPS]
    elif rest[:3] == ["-m", "dtmega", "evaluate"] and "--eval-iters" not in rest and "--task" not in rest:
        rest = [*rest, "--eval-iters", "2"]
    elif rest[:3] == ["-m", "dtmega", "generate"]:
        rest = [*rest, "--max-new-tokens", "8"]
    elif rest[:1] and rest[0].startswith("examples/"):
        model = _option(rest, "--model")
        if model is not None and model not in SMALL_MODELS:
            rest[rest.index("--model") + 1] = "debug"
        world = min(world, LOCAL_RANKS)
        rest = [*rest, "--steps", "2"]
        if _option(rest, "--compile") == "inductor":  # inductor's CPU compile is exercised by README's example
            rest[rest.index("--compile") + 1] = "aot_eager"
    launch = [python, *rest] if world == 1 and rest[:1] == ["-m"] else \
        [str(Path(python).with_name("torchrun")), "--nproc-per-node", str(world), *rest]
    if world == 1 and rest[:1] != ["-m"]:
        launch = [python, *rest]
    return shlex.join(launch)


def one_process_dtmega_argv(scaled: str, python: str) -> list[str] | None:
    """The dtmega arguments of a scaled command that runs `python -m dtmega ...` as one process
    (not a torchrun launch): the suite runs consecutive ones in one interpreter
    (tests/dtmega_commands.py, through the console script's entry point), else None."""
    tokens = shlex.split(scaled)
    if tokens[:3] == [python, "-m", "dtmega"] and len(tokens) > 3:
        return tokens[3:]
    return None
