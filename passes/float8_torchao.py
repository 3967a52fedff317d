"""Float8's torchao backend: torchao's `Float8Linear` (tensorwise or rowwise scaling) on the
linears the pass chose, converted before data parallelism wraps them (as torchao requires),
with FSDP2's FP8 all-gather of the weights when `param_gather` is set."""

from __future__ import annotations

from dtmega.passes.runtime import RuntimeHook


def apply_torchao(program, float8_pass, choice) -> None:
    """Converts the chosen linears of every local part to torchao's Float8Linear."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(float8_pass.recipe)
    if float8_pass.param_gather:
        config = Float8LinearConfig(**{**config.__dict__, "enable_fsdp_float8_all_gather": True})
    selected = set(choice.modules)
    for part in program.parts:
        convert_to_float8_training(part, config=config, module_filter_fn=lambda module, fqn: fqn in selected)
    if float8_pass.param_gather:
        program.add_hook(PrecomputeFloat8Scales(program.parts))


class PrecomputeFloat8Scales(RuntimeHook):
    """With FP8 all-gather, torchao computes the weights' scales for the next all-gather in one
    pass after each optimizer step (instead of one small reduction per weight)."""

    def __init__(self, parts):
        self.parts = parts

    def after_optimizer_step(self) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in self.parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
