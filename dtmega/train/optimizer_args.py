"""The optimizer section of `dtmega train`'s arguments: run length, schedules, precision, the optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dtmega.kernels.errors import DtmegaError
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt
from dtmega.train.schedule import ParamSchedule

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerArgs:
    """Batch sizes, schedule, AdamW, mixed precision and loss scaling, divergence checks."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("micro_batch_size", "global_batch_size", "train_iters",
        "lr_decay_iters", "lr_wsd_decay_iters", "loss_scale_window", "max_skipped_steps", "train_samples",
        "lr_decay_samples", "lr_wsd_decay_samples")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad",
        "hysteresis", "lr_warmup_samples", "lr_warmup_init", "start_weight_decay", "end_weight_decay")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("adam_eps", "initial_loss_scale", "min_loss_scale", "loss_scale")
    # coefficients in [0, 1): a beta of 1 never forgets, above 1 it grows without bound
    unit_interval: ClassVar[tuple[str, ...]] = ("adam_beta1", "adam_beta2", "lr_warmup_fraction", "sgd_momentum")

    micro_batch_size: int | None = _opt(None, "sequences per rank per micro-batch (default 1, or from --microbatches)")
    global_batch_size: int | None = _opt(None, "sequences per step (default: micro batch x data-parallel size)")
    train_iters: int | None = _opt(None, "optimizer steps")
    train_samples: int | None = _opt(None, "samples to train on, instead of --train-iters (steps = samples / global "
                                           "batch); the schedule's lengths are then in samples too")
    lr: float | None = _opt(None, "peak learning rate")
    min_lr: float = _opt(0.0, "final learning rate")
    lr_decay_style: str = _opt("linear", "decay after warmup", ("constant", "linear", "cosine", "inverse-square-root",
                                                                "WSD"))
    lr_warmup_iters: int = _opt(0, "linear warmup steps")
    lr_decay_iters: int | None = _opt(None, "steps until min_lr (default: --train-iters)")
    lr_wsd_decay_iters: int | None = _opt(None, "WSD: length of the final decay (required with WSD, as in Megatron)")
    lr_wsd_decay_style: str = _opt("exponential", "WSD decay shape", ("exponential", "linear", "cosine", "minus_sqrt"))
    lr_decay_samples: int | None = _opt(None, "with --train-samples: samples until min_lr (default: --train-samples)")
    lr_warmup_samples: int = _opt(0, "with --train-samples: linear warmup samples")
    lr_wsd_decay_samples: int | None = _opt(None, "with --train-samples: WSD's final decay in samples")
    lr_warmup_fraction: float | None = _opt(None, "warmup as a fraction of the decay length (instead of "
                                                  "--lr-warmup-iters/--lr-warmup-samples)")
    lr_warmup_init: float = _opt(0.0, "learning rate the warmup starts from")
    override_opt_param_scheduler: bool = _opt(False, "on resume, follow the schedule flags of this launch where "
                                                     "they differ from the checkpoint's (default: refused)",
                                              aliases=("--override-opt_param-scheduler",))
    use_checkpoint_opt_param_scheduler: bool = _opt(False, "on resume, follow the checkpoint's schedule where this "
                                                           "launch's flags differ (default: refused)",
                                                    aliases=("--use-checkpoint-opt_param-scheduler",))
    decoupled_lr: float | None = _opt(None, "a separate learning rate for the embedding and output layer (not "
                                            "supported yet)")
    decoupled_min_lr: float | None = _opt(None, "with --decoupled-lr: its final learning rate (not supported yet)")
    weight_decay: float = _opt(0.01, "weight decay (never on norms and biases)")
    start_weight_decay: float | None = _opt(None, "weight decay at the start, with --weight-decay-incr-style linear "
                                                  "or cosine")
    end_weight_decay: float | None = _opt(None, "weight decay at the end of the run, with --weight-decay-incr-style "
                                                "linear or cosine")
    weight_decay_incr_style: str = _opt("constant", "weight decay over the run: constant (--weight-decay), or from "
                                                    "--start-weight-decay to --end-weight-decay",
                                        ("constant", "linear", "cosine"))
    calculate_per_token_loss: bool = _opt(False, "the gradient of the global batch's token-weighted mean loss "
                                                 "(default, as Megatron: each micro-batch's own token mean, averaged "
                                                 "over micro-batches and data-parallel ranks)")
    clip_grad: float = _opt(1.0, "clip the global gradient norm to this (0 = off)")
    no_check_for_nan_in_loss_and_grad: bool = _opt(False, "never stop a run for non-finite losses or gradient "
                                                          "norms (such steps are still skipped)")
    max_skipped_steps: int = _opt(10, "non-finite steps in a row that stop the run as diverged (exit 2)")
    check_for_spiky_loss: bool = _opt(False, "a loss above 10x the recent maximum re-runs its step once on the same "
                                             "batch: reproduced = from the data or model, not = a transient fault")
    optimizer: str = _opt("adam", "adam (AdamW, decoupled weight decay, as Megatron's adam) or sgd (momentum "
                                  "--sgd-momentum, L2 weight decay); muon is not supported yet", ("adam", "sgd", "muon"))
    sgd_momentum: float = _opt(0.9, "momentum of --optimizer sgd")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.999, "AdamW beta2")
    adam_eps: float = _opt(1e-8, "AdamW epsilon")
    bf16: bool = _opt(False, "bf16 compute, fp32 master weights and gradient reduction")
    fp16: bool = _opt(False, "fp16 compute with dynamic loss scaling")
    loss_scale: float | None = _opt(None, "static loss scale for --fp16 (default: dynamic)")
    initial_loss_scale: float = _opt(2.0**32, "first dynamic loss scale")
    min_loss_scale: float = _opt(1.0, "smallest dynamic loss scale")
    loss_scale_window: int = _opt(1000, "steps without overflow before the scale doubles")
    hysteresis: int = _opt(2, "overflows tolerated before the scale halves")

    def check_schedule(self) -> None:
        """Refuses the run length and schedule flags that contradict each other (Megatron's rules),
        naming the flag to drop; reads the arguments only, so every rank refuses alike."""
        def given(names: tuple[str, ...]) -> list[str]:
            return [f"--{n.replace('_', '-')}" for n in names if getattr(self, n)]

        if self.train_iters is not None and self.train_samples is not None:
            raise ArgumentError("--train-iters and --train-samples both give the run's length. Fix: keep one")
        by_samples = self.train_samples is not None
        wrong = given(("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters") if by_samples else
                      ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"))
        if wrong:
            unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
            raise ArgumentError(f"{', '.join(wrong)} count {other}, but the run's length is given in {unit} "
                                f"(--train-{unit}). Fix: use the --lr-*-{unit} flags with --train-{unit}")
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both give the warmup. "
                                "Fix: keep one")
        if self.lr is not None and self.lr_warmup_init > self.lr:
            raise ArgumentError(f"--lr-warmup-init {self.lr_warmup_init} is above --lr {self.lr}: the warmup would "
                                "lower the rate. Fix: a --lr-warmup-init of at most --lr")
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            if None not in ends and ends[0] != ends[1]:
                raise ArgumentError(f"--start-weight-decay {ends[0]} and --end-weight-decay {ends[1]} differ, but "
                                    "--weight-decay-incr-style is constant. Fix: --weight-decay-incr-style linear "
                                    "(or cosine)")
        elif None in ends:
            raise ArgumentError(f"--weight-decay-incr-style {self.weight_decay_incr_style} needs --start-weight-decay "
                                "and --end-weight-decay")

    def total_steps(self, global_batch: int) -> int:
        """Optimizer steps of the run: --train-iters, or --train-samples over the global batch."""
        if self.train_samples is None:
            return int(self.train_iters or 0)
        if self.train_samples < global_batch:
            raise ArgumentError(f"--train-samples {self.train_samples} is less than one global batch ({global_batch} "
                                "sequences): the run would take no step. Fix: at least one global batch of samples")
        return self.train_samples // global_batch

    def schedules(self, global_batch: int) -> ParamSchedule:
        """The learning-rate and weight-decay schedule as Megatron's training.py builds it: every
        length in samples (iterations x the global batch when the run is iteration-based)."""
        if self.train_samples is not None:
            decay = float(self.lr_decay_samples or self.train_samples)
            warmup = float(self.lr_warmup_samples)
            wsd = self.lr_wsd_decay_samples
            length = float(self.train_samples)
        else:
            decay = float((self.lr_decay_iters or self.train_iters or 0) * global_batch)
            warmup = float(self.lr_warmup_iters * global_batch)
            wsd = self.lr_wsd_decay_iters * global_batch if self.lr_wsd_decay_iters is not None else None
            length = float((self.train_iters or 0) * global_batch)
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict "
                                "each other. Fix: keep one")
        start_wd = self.start_weight_decay if self.weight_decay_incr_style != "constant" else None
        end_wd = self.end_weight_decay if self.weight_decay_incr_style != "constant" else None
        constant = self.start_weight_decay if self.start_weight_decay is not None else self.weight_decay
        try:
            return ParamSchedule(float(self.lr_warmup_init), float(self.lr or 0.0), self.min_lr, warmup, decay,
                                 self.lr_decay_style, wsd, self.lr_wsd_decay_style,
                                 constant if start_wd is None else start_wd, constant if end_wd is None else end_wd,
                                 length, self.weight_decay_incr_style)
        except DtmegaError as error:
            raise ArgumentError(str(error)) from None

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer --optimizer names, over `model`'s (sharded) parameters, with Megatron's
        groups: no weight decay on norms and biases."""
        from dtmega.train.optim import adamw, sgd

        if self.optimizer == "sgd":
            return sgd(model, lr=self.lr or 0.0, weight_decay=self.weight_decay, momentum=self.sgd_momentum)
        return adamw(model, lr=self.lr or 0.0, weight_decay=self.weight_decay, betas=(self.adam_beta1, self.adam_beta2),
                     eps=self.adam_eps)

    @property
    def loss_averaging(self) -> str:
        """How a step's gradient averages the loss (`ParallelModel.forward_backward`'s `averaging`)."""
        return "tokens" if self.calculate_per_token_loss else "microbatches"

    @property
    def compute_dtype(self) -> str:
        """The parameters' compute dtype (--bf16, --fp16, else float32); master weights and
        gradient reduction stay fp32."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"
