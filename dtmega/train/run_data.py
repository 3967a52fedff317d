"""The run's datasets, decided once for the dry run and the launch alike.

`plan_run_data` reads only the data's indices and headers (no sample index is built, nothing is
written) and refuses everything the launch would refuse about the data: a split shorter than one
sample, a blend component with no documents in a split, a --split that leaves no training data,
an SFT file packed for another length. `prepare_run` calls it, so `dtmega train --dry-run` gives
the launch's verdict on data-dependent lines; the trainer builds the datasets from the same plan.
It also says, before any compute, when a validation the run would otherwise promise cannot
happen (a --split whose validation part holds no documents).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtmega.train.arg_fields import ArgumentError


def sample_counts(args: Any, global_batch: int) -> dict[str, int]:
    """Samples each split is built for, as Megatron's training.py asks its dataset builder
    (get_train_valid_test_num_samples: the sizes decide each split's epochs, so its order): the
    whole training (--train-samples, or --train-iters global batches), --eval-iters global batches
    for each of the train_iters // eval_interval + 1 validations, and the test split only when
    asked for by name (--test-data-path), evaluated once at the end as Megatron does. The test
    part of --split is never built, so a short one never blocks a run."""
    steps = args.total_steps(global_batch)
    train = args.train_samples if args.train_samples is not None else steps * global_batch
    validations = steps // args.eval_interval + 1 if args.eval_interval else 1
    eval_batch = args.eval_global_batch_size or global_batch  # Megatron's: --eval-global-batch-size's batches
    sizes = {"train": train, "valid": validations * args.eval_iters * eval_batch}
    if args.test_data_path:
        sizes["test"] = args.eval_iters * eval_batch
    return sizes


@dataclass
class RunData:
    """The run's splits as planned (`plans`: split -> what builds it, or None where the split is
    empty) and what the user should hear about them at start-up."""

    kind: str  # "mock", "sft" or "gpt"
    sizes: dict[str, int]
    plans: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def validates(self) -> bool:
        """Whether a validation split exists (and is asked for)."""
        return self.sizes.get("valid", 0) > 0 and (self.kind == "mock" or self.plans.get("valid") is not None)

    def build(self, args: Any, tokenizer: Any) -> dict[str, Any]:
        """The datasets themselves (sample indices built by rank 0 and cached; mock and SFT data
        need nothing built)."""
        if self.kind == "mock":
            from dtmega.data.mock import mock_datasets

            return mock_datasets(self.sizes, args.seq_length, tokenizer.vocab_size, tokenizer.eod, args.seed)
        if self.kind == "sft":
            return dict(self.plans)
        return {name: plan.build() if plan is not None else None for name, plan in self.plans.items()}


def plan_run_data(args: Any, global_batch: int) -> RunData:
    """The run's data, checked as the launch checks it; ArgumentError or the data's own
    DtmegaError naming the fix for data that cannot serve the run."""
    sizes = sample_counts(args, global_batch)
    if args.mock_data:
        notes = ["--no-mmap-bin-files with --mock-data: nothing is read from disk, so it changes nothing"
                 ] if args.no_mmap_bin_files else []
        return RunData("mock", sizes, {name: None for name in sizes}, notes)
    if args.sft:  # packed chat samples (dtmega preprocess --chat): splits by --split over whole samples
        from dtmega.data.sft_dataset import sft_datasets

        data = RunData("sft", sizes, sft_datasets(args.data_path[0], args.seq_length, list(args.split_weights), sizes))
    else:
        from dtmega.data.blend import DataConfig, plan_datasets

        config = DataConfig(tuple(args.data_path), args.split_weights, args.seq_length, args.seed, args.data_cache_path,
                            args.per_split_paths, mmap=not args.no_mmap_bin_files)
        data = RunData("gpt", sizes, plan_datasets(config, sizes))
        if args.dry_run is None:  # this machine builds the indices: each must fit in its memory (a dry run plans)
            from dtmega.data.gpt_dataset import check_index_fits
            from dtmega.data.indexed import IndexedDataset

            for plan in (plan for plan in data.plans.values() if plan is not None):
                for spec in plan.components:
                    check_index_fits(IndexedDataset(spec.prefix, mmap=False), spec)
    if data.plans.get("train") is None:
        raise ArgumentError(f"--split {args.split} leaves no training documents. Fix: a --split whose first part is "
                            "larger, or more data" if args.per_split_paths is None
                            else f"--train-data-path {' '.join(args.train_data_path or [])} holds no documents")
    valid_paths = args.per_split_paths[1] if args.per_split_paths is not None else None
    if sizes["valid"] > 0 and data.plans.get("valid") is None and valid_paths != ():  # () is noted by check_data_source
        data.notes.append(_no_validation_note(args, valid_paths))
    return data


def _no_validation_note(args: Any, valid_paths: tuple[str, ...] | None) -> str:
    """Why a run with --eval-iters > 0 will not validate, and the fixes."""
    if valid_paths:
        return (f"no validation will run: --valid-data-path {' '.join(valid_paths)} holds no documents. Fix: a "
                "--valid-data-path with documents, or --eval-iters 0 to train without validation")
    return (f"no validation will run: --split {args.split} gives the validation part no "
            f"{'samples' if args.sft else 'documents'} of this data (--eval-iters {args.eval_iters} and "
            f"--eval-interval {args.eval_interval} ask for it). Fix: a larger second --split weight, a "
            "--valid-data-path, or --eval-iters 0 to train without validation")
