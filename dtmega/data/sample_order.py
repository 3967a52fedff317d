"""Which dataset sample the training reads at each position: `--dataloader-type`.

- single (Megatron's default): position p reads sample p. The GPT dataset's own sample order is
  already shuffled (its shuffle index, fixed by `--seed`), and sized for the whole run.
- cyclic (Megatron's random sampler): every pass over the dataset's samples is a fresh
  permutation, drawn from (`--seed`, pass number), so a dataset smaller than the run is seen in
  another order each time around.

Both are pure functions of the position: a run resumed from `consumed_samples` reads exactly
what it would have, and the global batch at a position does not depend on the data-parallel
size (Megatron's random sampler deals samples per rank, so its order changes with the DP size;
here a resume under another DP size still reads the same batches).
"""

from __future__ import annotations

import numpy as np

from dtmega.kernels.errors import DtmegaError

DATALOADER_TYPES = ("single", "cyclic")


class CyclicOrder:
    """Position -> sample index, a fresh permutation of the usable samples in every pass. The
    last `length % global_batch` samples are left out of every pass (as Megatron's sampler
    does), so a global batch never straddles two passes."""

    def __init__(self, length: int, global_batch: int, seed: int):
        self.usable = length - length % global_batch
        if self.usable == 0:
            raise DtmegaError(f"--dataloader-type cyclic: the dataset's {length} samples do not fill one global batch "
                             f"of {global_batch}. Fix: a smaller --global-batch-size, or more data")
        self.seed = seed
        self._pass, self._permutation = -1, np.arange(0)

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of pass `epoch` (0-based)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.usable)

    def __call__(self, position: int) -> int:
        epoch, within = divmod(position, self.usable)
        if epoch != self._pass:
            self._pass, self._permutation = epoch, self.permutation(epoch)
        return int(self._permutation[within])
