"""--save-hf at the end of a run: the final checkpoint written as a Hugging Face model."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from dtmega.kernels.errors import DtmegaError


def export_final_hf(checkpoint: Path, save_hf: str, console) -> None:
    """Rank 0 writes `checkpoint` as a Hugging Face model in `save_hf`; the others wait for its
    outcome, and a failure is raised on every rank (never a hang)."""
    from dtmega.mesh import broadcast_object

    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        from dtmega.interop.hf_export import export_hf

        try:
            export_hf(checkpoint, save_hf)
        except (ValueError, OSError) as error:
            problem = f"--save-hf {save_hf}: {error} (the checkpoint {checkpoint} is saved)"
    problem = broadcast_object(problem)
    if problem:
        raise DtmegaError(problem)
    console.print(f"wrote the Hugging Face model {save_hf}")
