"""The `dtmega` command (also `python -m dtmega`): preprocess, train, evaluate, generate, serve, convert."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape

USAGE = """usage: dtmega {preprocess,train,evaluate,generate,serve,convert,plan,calibrate} [options]

  preprocess  JSONL -> Megatron .bin/.idx (tokenize, optionally train a BPE)
  train       pretrain with a parallel plan (Megatron pretrain_gpt.py flags or --config TOML)
  evaluate    loss and perplexity of a checkpoint on a dataset; --task wikitext / lambada
  generate    sample text from a checkpoint (greedy, top-k, top-p; KV cache; TP-aware)
  serve       HTTP server: Megatron's PUT /api, OpenAI's POST /v1/completions (batched; TP-aware)
  convert     checkpoints in and out: hf-to-dtmega, dtmega-to-hf, megatron-to-dtmega
  plan        rank every legal parallel plan for a model, GPU count and workload (memory, step time, MFU)
  calibrate   measure this machine's matmul rate, memory and collective bandwidth into a hardware file

`dtmega <command> --help` lists a command's options. Set DTMEGA_TRACEBACK=1 to see the
traceback behind an error message.
"""


SLOW_TO_START = ("evaluate", "generate", "serve", "convert")  # commands whose progress display follows the imports


def main(argv: list[str] | None = None) -> int:
    """Dispatches to a subcommand; bad input exits with status 2 and one clear message."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    commands = {
        "preprocess": "dtmega.data.preprocess_cli",
        "train": "dtmega.train.trainer",
        "evaluate": "dtmega.train.evaluate",
        "generate": "dtmega.train.generate",
        "serve": "dtmega.serve.cli",
        "convert": "dtmega.interop.convert_cli",
        "plan": "dtmega.cost.plan_cli",
        "calibrate": "dtmega.cost.calibrate",
    }
    if command not in commands:
        print(USAGE, file=sys.stderr)
        print(f"dtmega: unknown command {command!r}", file=sys.stderr)
        return 2
    import importlib

    if command in SLOW_TO_START and not {"-h", "--help"} & set(rest) and os.environ.get("RANK", "0") == "0":
        # importing torch and the passes takes seconds; say so at once (stderr: output stays pipeable)
        Console(stderr=True).print(f"[dim]dtmega {command}: starting (importing torch)[/dim]", highlight=False)
    module = importlib.import_module(commands[command])
    from dtmega.joining import DistributedTimeout
    try:
        module.main(rest)
        _shut_down_process_group()
    # Every dtmega input error (PlanError, ArgumentError, CheckpointError, InputError,
    # DatasetFormatError, ...) is a ValueError with a message that names the fix.
    except (ValueError, FileNotFoundError) as error:
        if os.environ.get("DTMEGA_TRACEBACK"):
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike; one message is enough
            # The message is printed as text: "pip install 'dtmega[te]'" must not read as markup.
            Console(stderr=True, soft_wrap=True).print(f"[bold red]dtmega {command}:[/bold red] {escape(str(error))}",
                                                       highlight=False)
        return 2
    except DistributedTimeout as error:  # said by each rank that waited: the missing rank cannot speak
        Console(stderr=True, soft_wrap=True).print(f"[bold red]dtmega {command}:[/bold red] {escape(str(error))}",
                                                   highlight=False)
        return 3
    return 0


def _shut_down_process_group() -> None:
    """Joins the process group's background threads before the interpreter exits (a gloo thread
    still running at exit can abort a finished job: "terminate called without an active
    exception")."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
