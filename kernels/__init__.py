"""dtmega.kernels: the leaf layer. Hot-path ops with a plain-PyTorch reference; imports nothing
of dtmega's."""

from dtmega.kernels.context_attention import context_parallel_attention
from dtmega.kernels.context_shards import CommStats, token_indices
from dtmega.kernels.cross_entropy import cross_entropy_context, is_vocab_sharded, per_token_cross_entropy
from dtmega.kernels.registry import KernelSpec, kernel_spec, kernels_for, register_kernel, registered_kernels

__all__ = [
    "CommStats", "KernelSpec", "context_parallel_attention", "cross_entropy_context", "is_vocab_sharded",
    "kernel_spec", "kernels_for", "per_token_cross_entropy", "register_kernel", "registered_kernels", "token_indices",
]
