"""The `dtmega` command (also `python -m dtmega`): preprocess, train, evaluate, generate, serve, convert."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback

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


# What a stop leaves behind, per command (matrix 3, D14: every command said the training's words)
STOPPED_WHAT = {
    "train": "Checkpoints already complete are intact (a save in progress is discarded, never half-read); resume with "
             "--load",
    "preprocess": "Nothing was written: the outputs are moved into place only when complete (their temporaries are "
                  "removed)",
    "convert": "Nothing was written: a checkpoint is named by latest only when complete (a partial one is discarded)",
    "generate": "Nothing was written",
    "evaluate": "Nothing was written",
    "serve": "The requests in flight were ended",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatches to a subcommand; bad input exits with status 2 and one clear message."""
    return _run(argv, launched=False)[0]


def entry() -> None:
    """The `dtmega` console script and `python -m dtmega`: runs the command, then ends the process.

    A command that ran under a process group ends without interpreter finalization, once its
    output is flushed and the group destroyed. `destroy_process_group` cannot stop the groups'
    gloo threads (`gloo_tcp_loop`, `pt_gloo_runloop`): DTensor's sharding caches (Python and
    C++) keep every mesh, and with it every group, alive until the interpreter tears torch down,
    in an order that sometimes destroys a running thread ("terminate called without an active
    exception", SIGABRT). Under torchrun or SLURM a finished job would then be restarted or
    marked failed (seen after a torchrun restart, under load)."""
    try:
        status, grouped = _run(None, launched=True)
    except BaseException as error:  # a crash (e.g. a peer's connection reset): its traceback, then the same end
        if isinstance(error, SystemExit) or not _process_group_exists():
            raise
        traceback.print_exc()
        status, grouped = (130 if isinstance(error, KeyboardInterrupt) else 1), True
    if grouped:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)
    sys.exit(status)


def _run(argv: list[str] | None, launched: bool) -> tuple[int, bool]:
    """(exit status, whether the command ran under a process group). `launched`: this process is
    the command (console script, `python -m dtmega`), not a call of `main()` inside another
    program: only then does a failure go to, and a broken collective look in, the launch's store
    (rank_errors.py), whose keys outlive a call."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return (0 if argv else 2), False
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
        return 2, False
    import importlib

    if command in SLOW_TO_START and not {"-h", "--help"} & set(rest) and os.environ.get("RANK", "0") == "0":
        # importing torch and the passes takes seconds; say so at once (stderr: output stays pipeable)
        Console(stderr=True).print(f"[dim]dtmega {command}: starting (importing torch)[/dim]", highlight=False)
    # Ctrl-C and SIGTERM are recorded as well as raised, so one swallowed in a finalizer is raised
    # again at the next step (stop_signals.py); while the command's module imports they are held
    # until the import is done. serve finishes its requests on a stop itself.
    from dtmega.stop_signals import Stopped, StopSignals

    handles_stops = command != "serve" and threading.current_thread() is threading.main_thread()
    stops = StopSignals(holding=True).install() if handles_stops else None
    try:
        module = importlib.import_module(commands[command])
        from dtmega.joining import DistributedTimeout, PeerFailed
        from dtmega.kernels.errors import DtmegaError
        from dtmega.rank_errors import describe, peers_failures, report_failure
    except BaseException:
        if stops is not None:
            stops.restore()
        raise
    status = 0
    try:
        if stops is not None:
            stops.release()  # raises a stop that arrived during the import
        module.main(rest)
    # Every input error (PlanError, ArgumentError, CheckpointError, ...) is a DtmegaError whose
    # message names the fix: one line, exit 2. Anything else is a bug: its traceback, exit 1.
    except DtmegaError as error:
        if os.environ.get("DTMEGA_TRACEBACK"):
            raise
        if launched and not isinstance(error, PeerFailed):  # rank-local faults exist: the others hear of it
            report_failure(str(error))
        # the launch's console shows rank 0: one message, the cause's; under torchrun without
        # --local-ranks-filter every rank's line shows, so the others say which rank they are
        rank = os.environ.get("RANK", "0")
        _say(command, str(error) if rank == "0" else f"rank {rank}: {error}", everywhere=True)
        status = 2
    except (KeyboardInterrupt, Stopped) as stop:  # Ctrl-C or SIGTERM: one line, not a traceback per rank
        name, status = ("SIGTERM", 143) if isinstance(stop, Stopped) else ("SIGINT (Ctrl-C)", 130)
        failures = peers_failures(wait=1.0) if launched and isinstance(stop, Stopped) else {}
        if failures:  # torchrun stops every rank once one exits with an error: that error is the news
            _say(command, describe(failures))
            return 2, _process_group_exists()
        _say(command, f"stopped by {name}. {STOPPED_WHAT.get(command, STOPPED_WHAT['train'])}")
        return status, _process_group_exists()  # peers may be mid-collective: the process ends without finalization
    except DistributedTimeout as error:  # said by each rank that waited: the missing rank cannot speak
        failures = peers_failures(wait=1.0) if launched else {}
        if failures:  # ... unless it could: a peer that stopped on an error said why
            _say(command, describe(failures))
            return 2, True
        _say(command, str(error), everywhere=True)
        return 3, True  # a peer is gone: the group is left as it is (the process ends without finalization)
    except Exception as error:  # a collective broken by a peer that stopped: its reason, not a gloo traceback
        failures = peers_failures() if launched and _process_group_exists() and not os.environ.get("DTMEGA_TRACEBACK") else {}
        if not failures:
            raise
        broke = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        _say(command, f"{describe(failures)} (this rank's collective broke: {broke})")
        return 2, True  # the group is broken: the process ends without finalization
    finally:
        if stops is not None:
            stops.restore()
    return status, _shut_down_process_group()


def _say(command: str, text: str, everywhere: bool = False) -> None:
    """One error line on stderr, on rank 0 only unless `everywhere`. Printed as text: "pip
    install 'dtmega[te]'" must not read as markup. Under torchrun the line also goes into the
    rank's error file, so that torchrun's failure summary, printed last, names it as the root
    cause instead of "To enable traceback see ..."."""
    _tell_torchrun(f"dtmega {command}: {text}")
    if everywhere or os.environ.get("RANK", "0") == "0":
        Console(stderr=True, soft_wrap=True).print(f"[bold red]dtmega {command}:[/bold red] {escape(text)}",
                                                   highlight=False)


def _tell_torchrun(line: str) -> None:
    """Writes `line` as this worker's error (torchrun's TORCHELASTIC_ERROR_FILE, the JSON its
    `@record` writes: a message string and a timestamp); never replaces one already written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as out:
            json.dump({"message": line, "timestamp": int(time.time())}, out)
    except OSError:
        pass  # the summary then says what it says without us: the line above is on the console anyway


def _process_group_exists() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _shut_down_process_group() -> bool:
    """Destroys the process group (every rank leaves its collectives); True if there was one."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            return True
    return False


if __name__ == "__main__":
    entry()
