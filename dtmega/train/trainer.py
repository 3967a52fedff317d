"""`dtmega train`: one loop for every plan.

    torchrun --nproc-per-node 4 -m dtmega train --config run.toml
    torchrun --nproc-per-node 8 -m dtmega train --model llama3-8b --tensor-model-parallel-size 4 ...
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import dtmega
from dtmega.data.loader import BatchLoader
from dtmega.data.sample_order import CyclicOrder
from dtmega.mesh import default_device_type, init_distributed, mesh_sizes
from dtmega.models import count_parameters
from dtmega.models.deepseek.mtp_runtime import MTPRuntime
from dtmega.moe_runtime import MoERuntime
from dtmega.stop_signals import raise_if_stopped
from dtmega.train.args import ArgumentError, TrainArgs, parse_train_args, to_toml_dict
from dtmega.train.checkpoint import (
    CheckpointError,
    SaveInProgress,
    load_checkpoint,
    load_runtime_state,
    read_state,
    select_checkpoint,
)
from dtmega.train.divergence import StepHealth
from dtmega.train.eval_batch import eval_batch
from dtmega.train.evaluate_loss import evaluate_loss
from dtmega.train.exit_conditions import ExitConditions
from dtmega.train.final_export import export_final_hf
from dtmega.train.memory_hygiene import release_memory
from dtmega.train.metric_sinks import open_sinks
from dtmega.train.metrics import (
    MetricsLogger,
    flops_per_token,
    make_console,
    memory_gib,
    peak_flops,
)
from dtmega.train.optim import LossScaler, clip_grads_, grad_norm, params_norm, scale_grads, zeros_in_grad
from dtmega.train.prepare import dry_run, prepare_run
from dtmega.train.process_settings import apply_process_settings
from dtmega.train.replica_check import check_replicas_when_due
from dtmega.train.save_lock import lock_save_dir
from dtmega.train.save_ownership import new_run_id
from dtmega.train.schedule import resumed_schedule
from dtmega.train.spiky_loss import SpikyLossCheck, random_state, set_random_state
from dtmega.train.step_timers import StepTimers
from dtmega.train.straggler import StragglerLog
from dtmega.train.watch import (
    RankMarks,
    check_same_arguments,
    launch_settings,
    looks_like_a_lost_peer,
    looks_like_timeout,
)


@dataclass
class TrainResult:
    """What a run did (returned to tests and scripts; rank-identical)."""

    losses: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    test_loss: float | None = None  # --test-data-path: the end-of-run evaluation
    iteration: int = 0
    checkpoint: Path | None = None
    unigram_entropy: float | None = None


# With --tensorboard-log-interval these go to TensorBoard and W&B from each N-th step's own record
# (not the --log-interval window's mean), so each series has one value per step.
PER_STEP_FIELDS = ("loss", "lr", "grad_norm", "loss_scale")


class Trainer:
    """Holds the run's pieces; `run()` trains, evaluates, logs and checkpoints."""

    def __init__(self, args: TrainArgs, notes: list[str], mesh=None):
        self.save_lock = None
        try:
            self._set_up(args, notes, mesh)
        except BaseException:  # a set-up that fails frees the --save lock it took (a later run may take it)
            if self.save_lock is not None:
                self.save_lock.release()
            raise

    def _set_up(self, args: TrainArgs, notes: list[str], mesh=None) -> None:
        """Everything `run()` needs: checks, process group, model, plan, checkpoint, data."""
        started = time.monotonic()  # --exit-duration-in-mins counts from here
        self.device_type = default_device_type()
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        run = prepare_run(args, world)  # every argument and file checked before any process group
        self.args = args = run.args  # with what start-up derived (--auto-plan's choices, a fresh start)
        self.exits = ExitConditions(args.exit_interval, args.exit_duration_in_mins, args.exit_signal_handler, started)
        apply_process_settings(args)  # --logging-level, --deterministic-mode
        init_distributed(self.device_type, timeout=timedelta(minutes=args.distributed_timeout_minutes))
        check_same_arguments(launch_settings(to_toml_dict(args), run.plan.to_toml()))  # before any work
        self.rank = dist.get_rank()
        self.leader = self.rank == 0
        self.console = make_console(self.leader)
        for note in [*notes, *run.notes]:
            self.console.print(f"[dim]note: {note}[/dim]")
        if (args.bf16 or args.fp16) and self.device_type == "cpu":
            self.console.print("[dim]note: --bf16/--fp16 on a CPU: most CPUs have no fast 16-bit matmuls, so this runs "
                               "slower than fp32 (measured ~9x on a 2-core AVX2 machine); it is meant for GPUs[/dim]")
        self.run_plan, self.spec = run, run.spec
        self.shape, self.tokenizer_spec, self.tokenizer = run.shape, run.tokenizer_spec, run.tokenizer
        self.config, self.plan, self.unigram_entropy = run.config, run.plan, run.unigram_entropy
        g = self.shape.global_batch
        self.train_iters = args.total_steps(g)  # --train-iters, or --train-samples over the global batch
        self.datasets = run.data.build(args, self.tokenizer)  # planned and checked by prepare_run
        sizes = self.shape.mesh_sizes()
        if mesh is not None and mesh_sizes(mesh) != sizes:
            raise ArgumentError(f"the mesh given has the sizes {mesh_sizes(mesh)}, but the arguments ask for {sizes}")
        self.mesh = mesh if mesh is not None else dtmega.make_mesh(**sizes, device_type=self.device_type)
        self.progress = RankMarks(self.mesh, args.distributed_timeout_minutes)
        self.saving: SaveInProgress | None = None  # an --async-save checkpoint being written
        # --async-save: DCP's background writer needs a host (gloo) group of its own, never the one
        # the training's collectives use from the main thread
        self.save_group = dist.new_group(backend="gloo") if args.async_save and args.save else None
        if args.save:  # one job per --save directory (save_lock.py), before any weight is built or read
            self.save_lock, lock_note = lock_save_dir(args.save)
            if lock_note:
                self.console.print(f"[dim]note: {lock_note}[/dim]")
        model = run.build_model(args.seed)
        self.num_params = count_parameters(model)
        if self.spec.materialize == "seeded" and self.device_type != "cpu":
            model.to(self.device_type)
        self.pm = dtmega.parallelize(model, self.mesh, self.plan, workload=run.workload)
        if self.spec.materialize == "meta" and args.load_hf and not args.load:
            self.pm.materialize()  # the Hugging Face weights are read next: no random values first
        elif self.spec.materialize == "meta":
            self.pm.init_weights(seed=args.seed)
        self.optimizer = args.make_optimizer(self.pm.module)
        # Megatron's OptimizerParamScheduler: counts the samples of successful updates (schedule.py)
        self.schedule, self.schedule_samples = args.schedules(g), 0
        self.scaler = None
        if args.fp16:
            static = args.loss_scale is not None
            self.scaler = LossScaler(args.loss_scale if static else args.initial_loss_scale, dynamic=not static,
                                     min_scale=args.min_loss_scale, window=args.loss_scale_window, hysteresis=args.hysteresis)
        self.iteration, consumed, self.loaded = 0, 0, None
        self.consumed_valid = 0  # validation reads on from where the last one stopped, as Megatron's
        self.run_id = new_run_id()  # written into state.json by rank 0 (save_ownership.py)
        self.resumed_behind_latest = False
        self.hf_files: dict[str, str] = {}  # a Hugging Face source's small files, for --save-hf and export
        if args.load:
            checkpoint, damaged = select_checkpoint(args.load)  # every file checked against its CRC-32
            self.resumed_behind_latest = bool(damaged)  # fell back past a damaged latest: saving behind it is the fix
            for note in damaged:
                self.console.print(f"[bold red]{note}[/bold red]")
            self.loaded = checkpoint
            weights_only = args.finetune or args.no_load_optim
            saved = read_state(checkpoint)
            if not weights_only and saved.get("optimizer_saved") is False:
                raise CheckpointError(f"{checkpoint} was saved without the optimizer state (--no-save-optim), so a "
                                      "resume cannot continue its optimizer. Fix: add --no-load-optim (a fresh "
                                      "optimizer at its step) or --finetune (its weights from step 0)")
            kind = saved.get("args", {}).get("optimizer", "adam")
            if not weights_only and kind != args.optimizer:
                raise CheckpointError(f"{checkpoint} holds the state of --optimizer {kind}, and this run asks for "
                                      f"--optimizer {args.optimizer}. Fix: --optimizer {kind} to resume it, or add "
                                      "--no-load-optim (a fresh optimizer of the new kind at its step)")
            state = load_checkpoint(checkpoint, self.pm.module, None if weights_only else self.optimizer,
                                    restore_rng=not (args.finetune or args.no_load_rng),
                                    pipeline_group=self.pm.pipeline_group(), strictness=args.dist_ckpt_strictness)
            if not args.finetune:
                self.iteration, consumed = state["iteration"], state["consumed_samples"]
                self.consumed_valid = int(state.get("consumed_valid_samples", 0))
                self.run_id = state.get("run_id") or self.run_id  # a resume continues the run it loads
            if not weights_only:  # Megatron loads its scheduler with the optimizer (a fresh one otherwise)
                self.schedule, note = resumed_schedule(self.schedule, state.get("schedule"),
                                                       args.override_opt_param_scheduler,
                                                       args.use_checkpoint_opt_param_scheduler)
                self.schedule_samples = int(state.get("schedule_samples", self.iteration * g))
                if note:
                    self.console.print(f"[dim]note: {note}[/dim]")
            self.hf_files = state.get("hf_files", {})  # a fine-tune resumed keeps its source's files
            template = self.pm.runtime_state_dict()
            missing = self.pm.load_runtime_state_dict(load_runtime_state(checkpoint, template))
            if missing:
                self.console.print(f"[dim]note: {args.load} holds no state for {len(missing)} run-time entries "
                                   f"(e.g. {missing[0]}: written without FP8?); they start fresh[/dim]")
            if self.scaler and state.get("loss_scaler") and not args.finetune:
                self.scaler.load_state_dict(state["loss_scaler"])
            if args.finetune:
                self.console.print(f"started from the weights of {checkpoint} (--finetune: step 0, fresh optimizer)")
            else:
                fresh = " with a fresh optimizer (--no-load-optim)" if args.no_load_optim else ""
                self.console.print(f"resumed from {checkpoint} at step {self.iteration} ({consumed} samples "
                                   f"consumed){fresh}")
        elif args.load_hf:
            from dtmega.interop.hf_checkpoint import HFCheckpoint
            from dtmega.interop.hf_import import files_kept_by_a_run

            source = HFCheckpoint.open(args.load_hf, tokenizer=self.tokenizer)
            for note in source.notes:
                self.console.print(f"[dim]note: {note}[/dim]")
            source.load_into(self.pm.module, self.config)
            self.hf_files = files_kept_by_a_run(source.kept, same_tokenizer=_same_tokenizer(self.tokenizer, args.load_hf))
            self.console.print(f"started from the Hugging Face model {args.load_hf} (weights only: fresh optimizer "
                               "and iteration count)")
        self.loader = BatchLoader(
            self.datasets["train"], g, self.pm.dp_rank, self.shape.dp, eod=self.tokenizer.eod,
            eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids, consumed_samples=consumed,
            order=CyclicOrder(len(self.datasets["train"]), g, args.seed) if args.dataloader_type == "cyclic" else None,
            reset_attention_mask=args.reset_attention_mask, micro_batch=self.shape.micro_batch,
        )
        self.spikes = SpikyLossCheck() if args.check_for_spiky_loss else None
        self.stragglers = StragglerLog(args.straggler_minmax_count) if args.log_straggler else None
        self.flops_per_token = flops_per_token(self.config, args.seq_length, self.spec)
        self.peak, self.peak_source = peak_flops(self.device_type, args.bf16 or args.fp16)
        self.moe = self.pm.hook(MoERuntime)
        self.mtp = self.pm.hook(MTPRuntime)  # DeepSeek's multi-token prediction: its loss logged apart
        moe_columns = ("moe_loss", "expert_load_max", "dropped") if self.moe else ()
        moe_columns += ("mtp_loss",) if self.mtp else ()
        self.timers = StepTimers(args.timing_log_level, args.timing_log_option, self.device_type)
        self.logger = MetricsLogger(leader=self.leader, log_file=args.log_file, console=self.console,
                                    sinks=open_sinks(args, self.leader, to_toml_dict(args)),
                                    for_sinks=self._for_sinks, columns=MetricsLogger.COLUMNS + moe_columns)

    def _for_sinks(self, key: str) -> bool:
        """Which record fields go to TensorBoard and W&B (Megatron's switches): timers only with
        --log-timers-to-tensorboard, the loss scale unless --no-log-loss-scale-to-tensorboard, and
        with --tensorboard-log-interval the per-step values come from their own records."""
        args = self.args
        if StepTimers.is_timer(key):
            return args.log_timers_to_tensorboard
        if key == "loss_scale":
            return not args.no_log_loss_scale_to_tensorboard
        return not (args.tensorboard_log_interval and key in PER_STEP_FIELDS)

    # ---- one step -------------------------------------------------------------------------
    def step(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | bool]:
        """Forward, backward, clip, update; returns (loss, grad norm, skipped) as device values:
        with bf16/fp32 on GPUs (fused AdamW) nothing here waits for the device, a step whose
        gradient norm is not finite is skipped by the optimizer kernel itself (`found_inf`)."""
        scale = self.scaler.scale if self.scaler else 1.0
        rng = random_state() if self.spikes else None
        self._start_dropout()
        with self.timers.phase("forward_backward"):
            loss = self.pm.forward_backward(batch, microbatches=self.shape.accumulation, loss_scale=scale,
                                             averaging=self.args.loss_averaging)
            if self.spikes is not None:
                loss = self._check_spike(batch, loss, rng, scale)
        with self.timers.phase("grad_norm" if self.timers.level >= 2 else "optimizer"):
            params = list(self.pm.parameters())  # after backward: the sharded parameters the optimizer holds
            if scale != 1.0:
                scale_grads(params, 1.0 / scale)
            norm = grad_norm(params, self.pm.pipeline_group())
            if self.args.log_num_zeros_in_grad:
                self.zeros_in_grad = zeros_in_grad(params, self.pm.pipeline_group())
        with self.timers.phase("optimizer"):
            return self._update(loss, norm, params)

    def _start_dropout(self) -> None:
        """Tells models with plan-independent dropout (the GPT family) the run's seed and the
        samples trained before this step, so a step's masks follow its samples' global indices
        (the same after a resume, and when a step is re-run)."""
        before = self.iteration * self.shape.global_batch
        for part in self.pm.program.parts:
            for module in part.modules():
                if hasattr(module, "set_dropout_state"):
                    module.set_dropout_state(self.args.seed, before)

    def _update(self, loss: torch.Tensor, norm: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor | bool]:
        """Clips and steps unless the step is skipped (a non-finite norm or loss)."""
        finite = torch.isfinite(norm)
        if not self.args.no_check_for_nan_in_loss_and_grad:
            finite = finite & torch.isfinite(loss.detach())  # a non-finite loss never updates the weights
        on_device = self.scaler is None and bool(self.optimizer.defaults.get("fused"))
        overflow: torch.Tensor | bool = ~finite if on_device else not bool(finite)
        if self.scaler:
            self.scaler.update(bool(overflow))
        if on_device:
            self.optimizer.found_inf = overflow.float()  # fused AdamW skips the update where it is 1
        if on_device or not overflow:
            if self.args.clip_grad > 0:
                clip_grads_(params, self.args.clip_grad, norm)
            for group in self.optimizer.param_groups:  # the schedule at the samples of the updates so far
                group["lr"] = self.schedule.lr(self.schedule_samples)
                if all(param.ndim > 1 for param in group["params"]):  # norms and biases never decay (optim._decay_groups)
                    group["weight_decay"] = self.schedule.weight_decay(self.schedule_samples)
            self.optimizer.step()
            self.pm.after_optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        if not bool(overflow):  # a skipped update does not advance the schedule (Megatron's update_successful)
            self.schedule_samples += self.shape.global_batch
        return loss.detach(), norm, overflow

    @property
    def logged_lr(self) -> float:
        """The learning rate Megatron logs for the step just taken: the one its scheduler set after
        the step (the next step's)."""
        return self.schedule.lr(self.schedule_samples)

    def _check_spike(self, batch, loss: torch.Tensor, rng, scale: float) -> torch.Tensor:
        """--check-for-spiky-loss: a spike re-runs forward and backward once on the same batch
        from the same random state (spiky_loss.py); returns the loss the step goes on with. The
        loss is the job's mean, the same on every rank, so every rank re-runs alike."""
        value = float(loss)
        if self.spikes.is_spike(value):
            self.optimizer.zero_grad(set_to_none=True)
            set_random_state(rng)
            self._start_dropout()  # the re-run draws the masks the first run drew
            loss = self.pm.forward_backward(batch, microbatches=self.shape.accumulation, loss_scale=scale,
                                             averaging=self.args.loss_averaging)
            spike = self.spikes.record(self.iteration + 1, value, float(loss))
            self.console.print(f"[bold {'yellow' if spike.reproduced else 'red'}]{spike.describe()}[/]")
        self.spikes.accept(float(loss))
        return loss

    def _state(self) -> dict:
        return {
            "iteration": self.iteration, "consumed_samples": self.loader.consumed_samples, "run_id": self.run_id,
            "consumed_valid_samples": self.consumed_valid, "schedule": self.schedule.state(),
            "schedule_samples": self.schedule_samples,
            "world_size": self.shape.world, "model": self.spec.name, "model_config": self.spec.config_to_dict(self.config),
            "args": to_toml_dict(self.args), "plan": self.plan.to_toml(),
            # the end-of-document token the run used (a Hugging Face directory's eos_token), so
            # that every later reader of the saved tokenizer.json takes the same one
            "tokenizer": {**self.tokenizer_spec.to_dict(), **_eod_token_of(self.tokenizer)},
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
            "optimizer_saved": not self.args.no_save_optim,
            **({"hf_files": self.hf_files} if self.hf_files else {}),
        }

    def save(self, background: bool = False) -> Path | None:
        """Saves this step (collective); `background` (--async-save): starts the write and returns
        None, `finish_background_save` publishes it later. A save in flight is finished first."""
        self.finish_background_save(wait=True)
        optimizer = None if self.args.no_save_optim else self.optimizer
        saving = SaveInProgress.start(self.args.save, self.iteration, self.pm.module, optimizer, self._state(),
                                      tokenizer_json=self.tokenizer.to_json(), runtime=self.pm.runtime_state_dict(),
                                      allow_older=self.args.overwrite_checkpoints or self.resumed_behind_latest,
                                      background_group=self.save_group if background else False,
                                      retain_interval=self.args.save_retain_interval)
        if background:
            self.saving = saving
            self.logger.event(f"saving checkpoint {saving.final} in the background")
            return None
        path = saving.finish()
        self.logger.event(f"saved checkpoint {path}")
        return path

    def finish_background_save(self, wait: bool) -> Path | None:
        """Publishes the --async-save checkpoint in flight (collective) once every rank has written
        its shards, or at once with `wait`; returns its path when it was published."""
        if self.saving is None:
            return None
        if not wait:
            written = torch.tensor([int(self.saving.written())], device=self.device_type)
            if self.shape.world > 1:
                dist.all_reduce(written, op=dist.ReduceOp.MIN)  # every rank decides alike
            if not written.item():
                return None
        saving, self.saving = self.saving, None
        path = saving.finish()
        self.logger.event(f"saved checkpoint {path} (written in the background)")
        return path

    def export_hf(self, checkpoint: Path) -> None:
        """--save-hf: the final checkpoint as a Hugging Face model (dtmega/train/final_export.py)."""
        export_final_hf(checkpoint, self.args.save_hf, self.console)

    def _release_memory(self, after_validation: bool) -> None:
        release_memory(self.args, self.iteration, self.device_type, after_validation)

    def validate(self, result: TrainResult, split: str = "valid") -> None:
        """--eval-iters batches of the validation split (or, once at the end, the test split of
        --test-data-path), logged and kept in `result`."""
        if self.datasets.get(split) is None or self.args.eval_iters <= 0:
            return
        self._release_memory(after_validation=True)
        from dtmega.progress import progress_bar

        # a line when it starts, then every few seconds in a log: a long validation is never silent
        what = "validation" if split == "valid" else "test evaluation"
        with progress_bar(f"{what} at step {self.iteration}", total=self.args.eval_iters, unit="batches") as bar:
            loss = evaluate_loss(self.pm, self.datasets[split], self.args, self.shape, self.tokenizer.eod,
                                 on_batch=bar.advance, start=self.consumed_valid if split == "valid" else 0)
        self._release_memory(after_validation=True)
        if split == "valid":
            self.consumed_valid += self.args.eval_iters * eval_batch(self.args, self.shape).global_batch
            result.validation.append((self.iteration, loss))
        else:
            result.test_loss = loss
        self.logger.log_validation(self.iteration, loss, split)

    def _moe_metrics(self, moe_losses: list[float]) -> dict:
        """Balancing loss, per-expert load (share of routed assignments per layer) and dropped
        fraction over the logging window; empty for a dense model."""
        if not self.moe:
            return {}
        stats = self.pm.moe_stats()
        loads = stats["expert_load"]
        experts = len(next(iter(loads.values()))) if loads else 1
        # The busiest expert's share relative to an even share (1.0 = perfectly balanced).
        peak = max((max(load) * experts for load in loads.values()), default=None)
        return {"moe_loss": float(sum(moe_losses)) / len(moe_losses), "expert_load_max": peak,
                "dropped": stats["dropped_fraction"], "expert_load": loads}

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Trains to --train-iters; a collective that times out becomes a DistributedTimeout
        naming where every rank is (watch.py)."""
        collecting = gc.isenabled()
        if self.args.manual_gc:
            gc.disable()  # collected at --manual-gc-interval steps and around validations instead
        self.exits.start()
        try:
            return self._run()
        except Exception as error:
            if self.shape.world > 1 and looks_like_timeout(error):
                raise self.progress.explain(error) from error
            if self.shape.world > 1 and looks_like_a_lost_peer(error) and not os.environ.get("DTMEGA_TRACEBACK"):
                raise self.progress.explain_lost_peer(error) from None
            raise
        finally:
            if self.args.manual_gc and collecting:
                gc.enable()
            self.exits.stop()
            if self.save_lock is not None:
                self.save_lock.release()

    def _run(self) -> TrainResult:
        args, shape = self.args, self.shape
        result = TrainResult(iteration=self.iteration, unigram_entropy=self.unigram_entropy)
        self.console.print(self.pm.report())
        self.console.print(
            f"{self.num_params:,} parameters"
            + (f" ({self.config.num_active_params():,} active per token)" if getattr(self.config, "moe", None) else "")
            + f" | world {shape.world} = PP {shape.pp} x DP {shape.dp} x CP {shape.cp} x TP {shape.tp}"
            + (f" (EP {shape.expert_parallel} of the DP" + (" x TP ranks)" if shape.expert_fold > 1 else " ranks)")
               if shape.expert_parallel > 1 else "") + " | "
            f"global batch {shape.global_batch} = micro {shape.micro_batch} x DP {shape.dp} x accumulation "
            f"{shape.accumulation} | {args.seq_length} tokens/sample | MFU peak: {self.peak_source}"
        )
        if self.unigram_entropy is not None:
            self.console.print(f"unigram entropy of the data: {self.unigram_entropy:.3f} nats/token")
        check_replicas_when_due(args, self.pm, self.iteration, start=True)
        window_losses, window_start, skipped, window_steps, window_moe, window_mtp = [], time.perf_counter(), 0, 0, [], []
        health = None
        if not args.no_check_for_nan_in_loss_and_grad:
            health = StepHealth(args.max_skipped_steps, loss_only=self.scaler is not None, console=self.console,
                                last_checkpoint=str(self.loaded) if self.loaded else None,
                                ln_vocab=math.log(self.config.vocab_size))
        if self.iteration >= self.train_iters:
            length = "--train-iters" if args.train_samples is None else "--train-samples / global batch"
            self.console.print(
                f"[bold yellow]nothing to train:[/bold yellow] the checkpoint is at step {self.iteration} and "
                f"{length} is {self.train_iters}, so this run ends here and saves nothing. Pass a larger "
                f"{length.split()[0]} to train on"
            )
        while self.iteration < self.train_iters:
            raise_if_stopped()  # a Ctrl-C or SIGTERM swallowed in a finalizer during the last step
            self.progress.mark(self.iteration + 1, "loading data")
            fetch_start = time.perf_counter()
            with self.timers.phase("data"):
                batch = next(self.loader).to(self.device_type)
            if self.stragglers:
                self.stragglers.add_data_time(time.perf_counter() - fetch_start)
            self.progress.mark(self.iteration + 1, "forward/backward and optimizer step")
            loss, norm, overflow = self.step(batch)  # device values: read only when logging
            self.iteration += 1
            self._release_memory(after_validation=False)
            check_replicas_when_due(args, self.pm, self.iteration)
            if health is not None:
                health.record(self.iteration, loss, norm)  # checks the step before this one
            window_losses.append(loss)
            window_moe.append(self.moe.last_loss if self.moe else 0.0)
            window_mtp.append(self.mtp.last_loss if self.mtp else 0.0)
            window_steps += 1
            skipped = skipped + overflow
            last = self.iteration == self.train_iters
            if args.tensorboard_log_interval and self.iteration % args.tensorboard_log_interval == 0 and self.leader:
                self.logger.log_scalars({"step": self.iteration, "loss": float(loss), "lr": self.logged_lr,
                                         "grad_norm": float(norm),
                                         **({"loss_scale": self.scaler.scale}
                                            if self.scaler and not args.no_log_loss_scale_to_tensorboard else {})})
            if self.iteration % args.log_interval == 0 or last:
                if self.device_type == "cuda":
                    torch.cuda.synchronize()
                window_losses = [float(x) for x in window_losses]
                result.losses.extend(window_losses)
                elapsed = time.perf_counter() - window_start
                tokens = window_steps * shape.global_batch * args.seq_length
                tflops = self.flops_per_token * tokens / elapsed / shape.world / 1e12
                moe = self._moe_metrics(window_moe)
                stragglers, straggler_line = self.stragglers.report(window_steps, elapsed) if self.stragglers else ({}, None)
                self.logger.log({
                    "step": self.iteration, "loss": sum(window_losses) / len(window_losses),
                    "lr": self.logged_lr, "grad_norm": float(norm),
                    "tokens_per_s": tokens / elapsed, "tflops_per_device": tflops,
                    "mfu": tflops * 1e12 / self.peak if math.isfinite(self.peak) else None,
                    "memory_gib": memory_gib(self.device_type), "skipped_steps": int(skipped),
                    "consumed_samples": self.loader.consumed_samples,
                    **({"loss_scale": self.scaler.scale} if self.scaler else {}),
                    **({"params_norm": params_norm(self.pm.parameters(), self.pm.pipeline_group())}
                       if args.log_params_norm else {}),
                    **({"num_zeros_in_grad": self.zeros_in_grad} if args.log_num_zeros_in_grad else {}),
                    **({"world_size": shape.world} if args.log_world_size_to_tensorboard else {}),
                    **self.timers.window(window_steps, elapsed),
                    **moe, **stragglers,
                    **({"mtp_loss": float(sum(window_mtp)) / len(window_mtp)} if self.mtp else {}),
                })
                if straggler_line:
                    self.console.print(straggler_line)
                self.logger.log_expert_load(self.iteration, moe.get("expert_load", {}))
                window_losses, window_steps, window_start, window_moe = [], 0, time.perf_counter(), []
                window_mtp = []
            if self.saving is not None:  # publish a background save every rank has written
                published = self.finish_background_save(wait=False)
                if published is not None:
                    result.checkpoint = published
                    if health is not None:
                        health.last_checkpoint = str(published)
            stop = None if last else self.exits.reason(self.iteration)
            if self.iteration % args.eval_interval == 0 and not last and stop is None:
                self.progress.mark(self.iteration, "validation")
                self.validate(result)
            if args.save and ((args.save_interval and self.iteration % args.save_interval == 0) or last
                              or stop is not None):
                if health is None or health.may_save():
                    self.progress.mark(self.iteration, "checkpoint save")
                    path = self.save(background=args.async_save and not last and stop is None)
                    if path is not None:
                        result.checkpoint = path
                        if health is not None:
                            health.last_checkpoint = str(path)
                else:
                    bad, kind = (health.streak, "non-finite") if health.streak else (health.dead, "dead")
                    self.console.print(f"[bold yellow]not saving at step {self.iteration}:[/bold yellow] "
                                       f"{len(bad)} {kind} steps in a row (since step {bad[0]})")
            if last:  # after the final checkpoint: however long it takes, the run's weights are saved
                self.progress.mark(self.iteration, "validation")
                self.validate(result)
                self.validate(result, "test")
            if stop is not None:
                self.console.print(f"stopping at step {self.iteration}: {stop}")
                break
        published = self.finish_background_save(wait=True)  # one still in flight (the final save was skipped)
        if published is not None:
            result.checkpoint = published
        if health is not None:
            health.finish()
        result.iteration = self.iteration
        if args.save_hf and result.checkpoint is not None and self.iteration == self.train_iters:
            self.progress.mark(self.iteration, "Hugging Face export")
            self.export_hf(result.checkpoint)
        if result.losses and self.unigram_entropy is not None:
            self.console.print(
                f"final training loss {result.losses[-1]:.3f} vs unigram entropy {self.unigram_entropy:.3f} nats"
            )
        self.logger.close()
        return result


def train(argv: list[str], mesh=None) -> TrainResult | None:
    """Runs `dtmega train` with command-line style arguments. `mesh` (of the sizes the arguments
    ask for) reuses a mesh across runs in one process: each new mesh adds process groups whose
    gloo threads slow every later collective. With --dry-run, checks the run and returns None."""
    args, notes = parse_train_args(argv)
    if args.dry_run is not None:
        dry_run(args, notes)
        return None
    return Trainer(args, notes, mesh=mesh).run()


main = train


def _eod_token_of(tokenizer) -> dict:
    token = getattr(tokenizer, "eod_token", None)
    return {"eod_token": token} if token else {}


def _same_tokenizer(tokenizer, hf_dir: str) -> bool:
    """Whether the run's tokenizer is the Hugging Face model's own (same vocabulary, merges and
    end-of-document token), whichever flags named it."""
    from dtmega.data.tokenizers import tokenizer_from_path

    try:
        own = tokenizer_from_path(hf_dir)
    except (OSError, ValueError):
        return False
    return own.to_json() == tokenizer.to_json() and own.eod == tokenizer.eod
