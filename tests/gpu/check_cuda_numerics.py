"""What only a CUDA GPU shows, checked by hand where one is lent (CI has none; docs/testing.md):

    torchrun --nproc-per-node 1 tests/gpu/check_cuda_numerics.py

On one GPU, fp32, the suite's tiny Llama against the unsharded model on the same GPU, 3 AdamW
steps of fresh random batches with masked tokens (loss every step, every gradient at step 0):

  * Recompute("selective") with compiled blocks, inductor and aot_eager (the combination that
    failed with a CheckpointError on CPU and on an H100 before the recomputed-attention op);
  * FuseKernels() forced onto every Triton kernel (norms, SwiGLU, RoPE, the fused loss), eager.

Bound 1e-4 relative: cuBLAS and inductor's generated reductions sum in other orders than the
reference's eager kernels (~1e-6 in fp32); a recompute that does not match its forward, or a
wrong kernel, is >= 1e-2. Prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dtmega  # noqa: E402  (installed first: a wheel's dtmega must not be shadowed by the source tree's)
from dtmega.mesh import init_distributed  # noqa: E402
from dtmega.passes import Compile, DataParallel, FuseKernels, Recompute  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's tests package
from tests.helpers import build_dtmega_llama, debug_llama, full, reference_loss, relative_error  # noqa: E402

BOUND = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only checks this script (aot_eager)
CHECKS = {
    "selective recompute + compiled blocks (inductor)": [Recompute("selective"), DataParallel("fsdp"),
                                                         Compile("inductor")],
    "selective recompute + compiled blocks (aot_eager)": [Recompute("selective"), DataParallel("fsdp"),
                                                          Compile("aot_eager")],
    "every Triton kernel, eager": [FuseKernels(impl="triton", rms_norm=True, swiglu=True, rope=True),
                                   DataParallel("fsdp")],
}


def worst_errors(passes: list) -> tuple[float, float]:
    """(worst loss error over 3 steps, worst gradient error at step 0) against the unsharded model."""
    reference, meta_copy = build_dtmega_llama(debug_llama(tie_embeddings=False), seed=5)
    reference.to(DEVICE)
    pm = dtmega.parallelize(meta_copy(), dtmega.make_mesh(dp_shard=1, device_type=DEVICE), dtmega.Plan(passes))
    pm.init_weights(seed=5)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5) for m in (reference, pm)]
    params = dict(reference.named_parameters())
    loss_error = grad_error = 0.0
    for step in range(3):
        batch = dtmega.synthetic_batch(4, 64, 256, seed=step, masked_fraction=0.25).to(DEVICE)
        for optimizer in optimizers:
            optimizer.zero_grad()
        expected = reference_loss(reference, batch)
        expected.backward()
        loss = pm.forward_backward(pm.shard_batch(batch))
        loss_error = max(loss_error, relative_error(loss, expected.detach()))
        if step == 0:
            grad_error = max(relative_error(full(p.grad), params[name].grad) for name, p in pm.named_parameters())
        for optimizer in optimizers:
            optimizer.step()
        pm.after_optimizer_step()
    return loss_error, grad_error


def main() -> int:
    init_distributed(DEVICE)
    failed = 0
    for name, passes in CHECKS.items():
        if DEVICE == "cpu" and "aot_eager" not in name:
            continue
        loss_error, grad_error = worst_errors(passes)
        ok = loss_error <= BOUND and grad_error <= BOUND
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: loss {loss_error:.1e}, gradients {grad_error:.1e} (bound {BOUND:.0e})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
