"""Where rank 0's metric records go besides the console and metrics.jsonl: TensorBoard
(--tensorboard-dir) and Weights & Biases (--wandb-project). Each sink takes the same records
(`write(prefix, record)`: "train" or "valid", numbers as scalars, per-layer vectors as
histograms) at the step the record names."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from dtmega.mesh import broadcast_object
from dtmega.train.arg_fields import ArgumentError


class MetricSink(Protocol):
    """A destination for metric records."""

    def write(self, prefix: str, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """Numbers by key; a list of numbers (one per rank: --timing-log-option all) as key/rankN."""
    scalars = {}
    for key, value in record.items():
        if key != "step" and _number(value):
            scalars[key] = value
        elif isinstance(value, list) and value and all(_number(item) for item in value):
            scalars.update({f"{key}/rank{rank}": item for rank, item in enumerate(value)})
    return scalars


def _vectors(record: dict[str, Any]) -> dict[str, list[float]]:
    """Per-layer vectors (the MoE expert load: {layer: [share, ...]}), named key/layer."""
    return {f"{key}/{name}": values for key, value in record.items() if isinstance(value, dict)
            for name, values in value.items()}


class TensorBoardSink:
    """torch's SummaryWriter: scalars as `prefix/key`, vectors as histograms."""

    def __init__(self, directory: str, queue_size: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(directory, max_queue=queue_size)

    def write(self, prefix: str, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in _scalars(record).items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)
        for key, values in _vectors(record).items():
            self.writer.add_histogram(f"{prefix}/{key}", torch.tensor(values), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (Megatron's --wandb-* flags): the run's arguments as its config,
    each record logged at its step; WANDB_MODE=offline writes it under `directory` only."""

    def __init__(self, project: str, name: str | None, directory: str, entity: str | None, config: dict[str, Any]):
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, dir=directory, entity=entity, config=config)

    def write(self, prefix: str, record: dict[str, Any]) -> None:
        values: dict[str, Any] = {f"{prefix}/{key}": value for key, value in _scalars(record).items()}
        values.update({f"{prefix}/{key}": self.wandb.Histogram(vector) for key, vector in _vectors(record).items()})
        self.run.log(values, step=record["step"])

    def close(self) -> None:
        """Finishes the run and shuts wandb's service down: its files are complete on disk, and a
        later run in this process (train() called again) reads the environment afresh."""
        self.run.finish()
        self.wandb.teardown()


def open_sinks(args: Any, leader: bool, config: dict[str, Any]) -> list[MetricSink]:
    """The sinks the arguments ask for, opened on the leader (an empty list elsewhere).
    Collective: a W&B run that cannot start (no login for online mode, a bad entity) is raised
    on every rank, with its fix, instead of leaving the others waiting."""
    sinks: list[MetricSink] = []
    problem = None
    if leader:
        if args.tensorboard_dir:
            sinks.append(TensorBoardSink(args.tensorboard_dir, args.tensorboard_queue_size))
        if args.wandb_project:
            try:
                sinks.append(WandbSink(args.wandb_project, args.wandb_exp_name, args.wandb_dir, args.wandb_entity,
                                       config))
            except Exception as error:  # wandb's own errors (UsageError, CommError, ...) have no common base
                problem = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    problem = broadcast_object(problem)
    if problem:
        for sink in sinks:
            sink.close()
        raise ArgumentError(f"--wandb-project {args.wandb_project}: Weights & Biases could not start a run ({problem}). "
                            "Fix: `wandb login` (or WANDB_API_KEY) for online logging, or WANDB_MODE=offline to write "
                            f"the run under {args.wandb_dir} and `wandb sync` it later")
    return sinks
