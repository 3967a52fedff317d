"""The checkpoint section of `dtmega train`'s arguments: checkpoints, evaluation, exits, memory hygiene."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class CheckpointArgs:
    """Checkpoints, evaluation, logging and the collective timeout."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("save_interval", "save_retain_interval", "eval_interval", "log_interval",
        "straggler_minmax_count", "exit_interval", "eval_global_batch_size", "eval_micro_batch_size",
        "check_weight_hash_across_dp_replicas_interval")
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("eval_iters", "seed", "manual_gc_interval")
    # strictly positive reals
    positive: ClassVar[tuple[str, ...]] = ("distributed_timeout_minutes", "exit_duration_in_mins")

    save: str | None = _opt(None, "checkpoint directory to write")
    load: str | None = _opt(None, "checkpoint directory (or iter_* directory) to resume from")
    load_hf: str | None = _opt(None, "Hugging Face model directory to start from: its config, tokenizer and "
                               "weights, with a fresh optimizer and iteration count (Megatron's --finetune); a "
                               "checkpoint in --load takes precedence, so a restarted run resumes")
    save_hf: str | None = _opt(None, "also write the final checkpoint as a Hugging Face model directory (needs --save)")
    finetune: bool = _opt(False, "start from --load's weights only: iteration 0, the data from its start, a fresh "
                                 "optimizer and random state (Megatron's --finetune)")
    no_load_optim: bool = _opt(False, "resume --load's weights, step and data position with a fresh optimizer")
    no_load_rng: bool = _opt(False, "resume without restoring the saved random-number generator states")
    no_save_optim: bool = _opt(False, "save checkpoints without the optimizer state (smaller; resuming them needs "
                                      "--no-load-optim or --finetune)")
    overwrite_checkpoints: bool = _opt(False, "write into a --save that holds checkpoints this run does not resume "
                                              "(another run's, or ones further along than --load): start over there "
                                              "on purpose; without it such a --save is refused")
    save_interval: int | None = _opt(None, "steps between checkpoints (and one at the end)")
    save_retain_interval: int | None = _opt(None, "keep only the newest checkpoint and those at multiples of this "
                                                  "many steps: each save deletes the previous latest unless its step "
                                                  "is such a multiple (a multiple of --save-interval)")
    async_save: bool = _opt(False, "write the --save-interval checkpoints in the background (DCP's async_save: the "
                                   "shards are copied to host memory, then written while training goes on; the "
                                   "checkpoint is published at the first step every rank has written it). The final "
                                   "and stopping saves wait")
    exit_interval: int | None = _opt(None, "stop (after saving, with --save) at the first step that is a multiple of "
                                           "this")
    exit_signal_handler: bool = _opt(False, "on SIGTERM, finish the step, save (with --save) and exit with status 0 "
                                            "(a preemption's clean stop; without it SIGTERM stops at once, status 143)")
    exit_duration_in_mins: float | None = _opt(None, "stop (after saving, with --save) at the first step after this "
                                                     "many minutes since the start (all ranks agree on the step)")
    eval_interval: int = _opt(1000, "steps between validation runs")
    eval_iters: int = _opt(100, "validation batches per run")
    eval_global_batch_size: int | None = _opt(None, "sequences per validation batch over all data-parallel ranks "
                                                    "(default --global-batch-size; a multiple of "
                                                    "--eval-micro-batch-size x the data-parallel size)")
    eval_micro_batch_size: int | None = _opt(None, "sequences per validation micro-batch (default --micro-batch-size)")
    log_interval: int = _opt(100, "steps between metric logs")
    check_weight_hash_across_dp_replicas_interval: int | None = _opt(
        None, "at the start and every this many steps, hash every replicated weight and compare the copies over "
              "the ranks the plan replicates it on (data-parallel replicas, TP, CP, EP; dtmega/replicas.py); a "
              "mismatch stops the run naming the weight and ranks")
    test_mode: bool = _opt(False, "Megatron's real-time consistency test: the replicated-weight check after every "
                                  "step (Megatron compares the q/k norm weights over TP and DP ranks in each forward)")
    log_straggler: bool = _opt(False, "at every log: each rank's step time and batch-fetching time, the fastest "
                                      "and slowest ranks named (one small all-gather)")
    straggler_minmax_count: int = _opt(1, "with --log-straggler: how many fastest and slowest ranks to name")
    distributed_timeout_minutes: float = _opt(10.0, "how long a rank waits for the others at start-up and in any "
                                                    "collective before the run stops naming who is missing")
    ckpt_format: str = _opt("torch_dist", "checkpoint format: torch_dist (sharded torch.distributed.checkpoint "
                                          "directories, the one format dtmega writes; torch_dcp and fsdp_dtensor "
                                          "name the same here; torch, Megatron's legacy format, is not supported)",
                            ("torch_dist", "torch_dcp", "fsdp_dtensor", "torch"))
    manual_gc: bool = _opt(False, "turn Python's automatic garbage collector off for the run and collect at "
                                  "--manual-gc-interval steps and around validations (no collector pauses at "
                                  "random steps, which stall every rank of a large job)")
    manual_gc_interval: int = _opt(0, "with --manual-gc: steps between collections (0: only around validations and "
                                      "at the end)")
    no_manual_gc_eval: bool = _opt(False, "with --manual-gc: no collection around validations")
    empty_unused_memory_level: int = _opt(0, "release the CUDA caching allocator's unused blocks: 1 after every "
                                             "step, 2 also after every validation (0: never; no effect on a CPU)",
                                          (0, 1, 2))
    profile: bool = _opt(False, "profile steps --profile-step-start to --profile-step-end (not supported yet)")
    profile_step_start: int = _opt(10, "with --profile: the first profiled step")
    profile_step_end: int = _opt(12, "with --profile: the step after the last profiled one")
    seed: int = _opt(1234, "random seed (init and data order)")
