"""Which implementation a kernel op runs: its plain-PyTorch reference or its Triton kernel.

Every op in kernels/ has both. The reference is the ground truth and what CPU training runs;
the Triton kernel runs on CUDA tensors, or on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how the tests check it on machines without a GPU. Triton is
imported lazily, so `import dtmega.kernels` works where it is not installed.

Triton decides at `@triton.jit` time whether a kernel is compiled or interpreted, so kernels
are built on first use by a `kernel_factory`, once per interpreter mode.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Any, Callable, TypeVar

import torch

IMPLS = ("auto", "reference", "triton")

# Triton launches per kernel name, so tests can check that the Triton path really ran.
LAUNCHES: collections.Counter[str] = collections.Counter()

T = TypeVar("T")


@functools.cache
def triton_available() -> bool:
    """True if triton imports (it is absent on CPU-only installs, and never required)."""
    try:
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True if Triton kernels run under the interpreter (on CPU tensors): TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_ready() -> bool:
    """True if triton's own jitted library (tl.sum, tl.max, ...) was built for the interpreter.
    Triton decides that when `triton.language` is first imported, so TRITON_INTERPRET=1 must be
    set before anything (torch.compile included) imports triton."""
    if not triton_available():
        return False
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def use_triton(t: torch.Tensor) -> bool:
    """The 'auto' choice: Triton where it imports and `t` is on CUDA (or the interpreter is on)."""
    return triton_available() and (t.is_cuda or interpreting())


def check_impl(impl: str) -> None:
    """Rejects an unknown `impl` early, at the public function, with the accepted values."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def wants_triton(impl: str, t: torch.Tensor) -> bool:
    """Resolves `impl` ('auto' | 'reference' | 'triton') for an op whose main input is `t`.

    Resolved inside the custom ops (at run time, not at trace time), so a compiled graph holds
    the user's choice and the device decides. 'triton' where it cannot run is an error, not a
    silent fallback: a test asking for the kernel must get the kernel.
    """
    check_impl(impl)
    if impl == "reference":
        return False
    if impl == "auto" and not use_triton(t):
        return False
    if not triton_available():
        raise RuntimeError("impl='triton' but triton does not import here")
    if not (t.is_cuda or interpreting()):
        raise RuntimeError("impl='triton' on CPU tensors needs the interpreter: set TRITON_INTERPRET=1")
    if interpreting() and not interpreter_ready():
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported (its library was built for "
                           "the compiler): set it before anything imports triton")
    return True


def kernel_factory(build: Callable[[], T]) -> Callable[[], T]:
    """Memoizes `build()` (which imports triton and defines the jitted kernels) per interpreter
    mode: `@triton.jit` reads TRITON_INTERPRET when it decorates, so kernels built before the
    variable was set would never be interpreted.

    Names a kernel uses (`tl`, jitted helpers it calls) must be module globals, which `build`
    declares `global`: the interpreter re-executes a kernel's source in its module's globals,
    so closure variables of `build` would not resolve there."""
    built: dict[bool, T] = {}

    @functools.wraps(build)
    def get() -> T:
        mode = interpreting()
        if mode not in built:
            built[mode] = build()
        return built[mode]

    return get


def launch(name: str, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launches `kernel[grid](*args, **kwargs)` and counts it under `name` in LAUNCHES."""
    LAUNCHES[name] += 1
    kernel[grid](*args, **kwargs)


def num_warps_for(block: int) -> int:
    """Warps for a program working on `block` elements at a time (4 up to 2K, then more)."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def persistent_programs(t: torch.Tensor, rows: int) -> int:
    """Programs for a row loop that accumulates per-program partial sums (e.g. a norm weight's
    gradient): a few per SM on CUDA, a handful under the interpreter; never more than `rows`."""
    if t.is_cuda:
        target = 4 * torch.cuda.get_device_properties(t.device).multi_processor_count
    else:
        target = 4
    return max(1, min(rows, target))
