"""The logging section of `dtmega train`'s arguments: where the metrics go (console,
metrics.jsonl, TensorBoard, Weights & Biases), how often, and which timers are measured.
Megatron's spellings and defaults, except where a line below says why not."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from dtmega.train.arg_fields import ArgumentError, opt


@dataclass(frozen=True)
class LoggingArgs:
    """Metrics sinks, their intervals, and the step timers."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("tensorboard_log_interval", "tensorboard_queue_size")

    log_file: str | None = opt(None, "metrics.jsonl: one JSON object per logged step")
    tensorboard_dir: str | None = opt(None, "TensorBoard event directory")
    # Megatron's default is 1. Here the default writes the --log-interval records only: reading a
    # step's loss makes the host wait for the device, and a run that asked for no per-step
    # scalars should not pay for them.
    tensorboard_log_interval: int | None = opt(None, "also write each N-th step's own loss, learning rate and "
                                                     "gradient norm to TensorBoard and W&B (default: only the "
                                                     "--log-interval records, so no step waits to read its loss)")
    tensorboard_queue_size: int = opt(1000, "TensorBoard events held before a write to disk")
    log_timers_to_tensorboard: bool = opt(False, "write the step timers (iteration time; with --timing-log-level 1 "
                                                 "or 2 the phases) to TensorBoard and W&B")
    timing_log_level: int = opt(0, "0: iteration time only (no extra synchronization); 1: also data, forward-"
                                   "backward and optimizer time per step; 2: also the gradient norm and clipping "
                                   "apart from the optimizer (levels 1-2 wait for the device at each phase)", (0, 1, 2))
    timing_log_option: str = opt("minmax", "with --timing-log-level 1-2, each phase over the ranks: its max, min and "
                                           "max, or every rank's", ("max", "minmax", "all"))
    no_log_loss_scale_to_tensorboard: bool = opt(False, "leave the fp16 loss scale out of TensorBoard and W&B")
    log_world_size_to_tensorboard: bool = opt(False, "write the world size to TensorBoard and W&B at each log step")
    log_params_norm: bool = opt(False, "log the L2 norm of all parameters (as if unsharded) at every log step")
    log_num_zeros_in_grad: bool = opt(False, "log how many gradient entries are exactly zero (one count per step)")
    logging_level: int | None = opt(None, "Python logging level for every logger (10 debug ... 50 critical; Megatron's "
                                          "--logging-level)")
    wandb_project: str | None = opt(None, "log to this Weights & Biases project (what TensorBoard gets, from rank "
                                          "0); WANDB_MODE=offline writes it locally for a later `wandb sync`")
    wandb_exp_name: str | None = opt(None, "the W&B run's name")
    wandb_save_dir: str | None = opt(None, "where W&B writes its files (default: --save's wandb/)")
    wandb_entity: str | None = opt(None, "the W&B team or user that owns the project")

    @property
    def wandb_dir(self) -> str | None:
        """Where W&B writes (Megatron's rule: --wandb-save-dir, else --save/wandb); None without
        --wandb-project."""
        if not self.wandb_project:
            return None
        if self.wandb_save_dir:
            return self.wandb_save_dir
        save = getattr(self, "save", None)
        return str(Path(save) / "wandb") if save else None

    def check_logging(self) -> list[str]:
        """Refuses W&B settings that cannot log, naming the fix; returns notes for flags that
        have nothing to act on. Reads the arguments (and whether wandb is installed) only."""
        notes = []
        stray = [flag for flag, value in (("--wandb-exp-name", self.wandb_exp_name),
                                          ("--wandb-save-dir", self.wandb_save_dir),
                                          ("--wandb-entity", self.wandb_entity)) if value]
        if stray and not self.wandb_project:
            raise ArgumentError(f"{stray[0]} needs --wandb-project: W&B logs only into a project. Fix: add "
                                "--wandb-project NAME, or drop " + " ".join(stray))
        if self.wandb_project:
            if self.wandb_dir is None:
                raise ArgumentError("--wandb-project needs a directory for W&B's files: --wandb-save-dir, or --save "
                                    "(then --save's wandb/). Fix: add --wandb-save-dir DIR")
            if importlib.util.find_spec("wandb") is None:
                raise ArgumentError("--wandb-project logs with the wandb package, which is not installed here. Fix: "
                                    "pip install 'dtmega[wandb]' (or pip install wandb), or drop --wandb-project")
        sinks = bool(self.tensorboard_dir or self.wandb_project)
        for flag, given in (("--tensorboard-log-interval", self.tensorboard_log_interval is not None),
                            ("--log-timers-to-tensorboard", self.log_timers_to_tensorboard),
                            ("--log-world-size-to-tensorboard", self.log_world_size_to_tensorboard)):
            if given and not sinks:
                notes.append(f"{flag} has nothing to write to: add --tensorboard-dir DIR (or --wandb-project NAME)")
        return notes
