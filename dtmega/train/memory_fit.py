"""Whether a launch's model can fit at all, from its config alone, before anything is built.

`--vocab-size 10^12` or `--hidden-size 65536` on one rank used to end in a raw allocation error
after the model was built, and `--num-layers 10^6` spent minutes building a meta model without a
word (reliability matrix 3, A1-A3). The weights alone, in the run's dtype and spread over every
rank of the world (the most any plan can spread them), are a lower bound of what each rank
holds; past this machine's memory the launch is refused naming the sizes. A dry run plans for
another machine and is not refused here."""

from __future__ import annotations

import os
from typing import Any

import torch

from dtmega.kernels.errors import DtmegaError


def machine_memory_bytes(device_type: str) -> int | None:
    """One device's memory (CUDA) or this host's physical memory (CPU); None when unknown."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_weights_fit(config: Any, world: int, bytes_per_param: int, device_type: str) -> None:
    """Refuses a model whose weights, divided over all `world` ranks, exceed one rank's memory."""
    count = getattr(config, "num_params", None)
    memory = machine_memory_bytes(device_type)
    if count is None or memory is None:
        return
    params = count()
    per_rank = params * bytes_per_param // max(1, world)
    if per_rank > memory:
        sizes = ", ".join(f"{flag} {getattr(config, field)}" for flag, field in (
            ("--num-layers", "n_layers"), ("--hidden-size", "dim"), ("--vocab-size", "vocab_size"))
            if hasattr(config, field))
        raise DtmegaError(f"the model has {params:,} parameters ({sizes}): their weights alone take "
                          f"{per_rank / 2**30:,.1f} GiB on each of the {world} ranks even if every plan spread them, "
                          f"more than this machine's {memory / 2**30:,.1f} GiB. Fix: smaller sizes, or more ranks "
                          "(dtmega train --dry-run N checks a launch for another machine)")
