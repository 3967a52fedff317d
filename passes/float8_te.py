"""Float8's Transformer Engine backend (`--transformer-impl transformer_engine`): the chosen
linears become `transformer_engine.pytorch.Linear` (weights carried over by name) and every
local part's forward runs inside `fp8_autocast` with the recipe asked for (delayed, current
tensorwise, blockwise, MXFP8). Written against Transformer Engine 2.x's documented API;
Transformer Engine does not install on the machines this project is tested on (its build needs
CUDA), so this backend is exercised only where it imports (docs/fp8.md says what was run)."""

from __future__ import annotations

from torch import nn


def te_recipe(float8_pass):
    """The Transformer Engine recipe object for the pass's recipe and format."""
    from transformer_engine.common import recipe

    fmt = recipe.Format.HYBRID if float8_pass.format == "hybrid" else recipe.Format.E4M3
    if float8_pass.recipe == "delayed":
        return recipe.DelayedScaling(fp8_format=fmt, amax_history_len=float8_pass.amax_history_len,
                                     amax_compute_algo=float8_pass.amax_compute_algo)
    if float8_pass.recipe == "tensorwise":
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    if float8_pass.recipe == "blockwise":
        return recipe.Float8BlockScaling(fp8_format=fmt)
    if float8_pass.recipe == "mxfp8":
        return recipe.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"Transformer Engine has no {float8_pass.recipe!r} recipe here")


def apply_transformer_engine(program, float8_pass, choice) -> None:
    """Swaps the chosen nn.Linear modules for te.Linear and wraps each part in fp8_autocast."""
    import transformer_engine.pytorch as te

    from dtmega.passes.float8_groups import amax_group

    if program.role_size("tensor") > 1:
        raise ValueError("Transformer Engine's linears shard themselves (their own tensor parallelism); with dtmega's "
                         "TensorParallel use backend='dtmega'")
    for fqn in choice.modules:
        parent_fqn, _, name = fqn.rpartition(".")
        for parent in program.modules_at(parent_fqn):
            old: nn.Linear = getattr(parent, name)
            new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                            params_dtype=old.weight.dtype, device=old.weight.device)
            new.weight = old.weight
            if old.bias is not None:
                new.bias = old.bias
            setattr(parent, name, new)
    recipe, group = te_recipe(float8_pass), amax_group(program)
    for part in program.parts:
        forward = part.forward

        def fp8_forward(*args, _forward=forward, **kwargs):
            with te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group):
                return _forward(*args, **kwargs)

        part.forward = fp8_forward
