"""--manual-gc and --empty-unused-memory-level: when the trainer collects garbage and releases
the CUDA caching allocator's unused blocks."""

from __future__ import annotations

import gc

import torch


def release_memory(args, iteration: int, device_type: str, after_validation: bool) -> None:
    """--manual-gc's collections (every --manual-gc-interval steps; around validations unless
    --no-manual-gc-eval) and --empty-unused-memory-level's CUDA cache release."""
    if args.manual_gc and (after_validation and not args.no_manual_gc_eval
                           or not after_validation and args.manual_gc_interval
                           and iteration % args.manual_gc_interval == 0):
        gc.collect()
    if device_type == "cuda" and args.empty_unused_memory_level >= (2 if after_validation else 1):
        torch.cuda.empty_cache()
