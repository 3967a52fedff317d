"""A module's precision as a typed decision in the layout (`ModuleLayout.precision`).

Written by `DataParallel` on its units (the dtype a unit computes in, the dtype gradients are
reduced in, CPU offload; or, on one data-parallel rank, the autocast the forward runs under) and
by `Float8` on linears (FP8 with its recipe and format, or why a linear stays in high
precision). Read by `DataParallel.apply` (FSDP's policy), the fused loss (its autocast) and the
cost model; shown by the report and written to TOML as its short text, which `parse` reads
back ("param=bf16 reduce=fp32 offload=cpu", "autocast=bf16", "fp8 delayed hybrid", "bf16:
why")."""

from __future__ import annotations

from dataclasses import dataclass

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LONG = {short: name for name, short in SHORT.items()}


@dataclass(frozen=True)
class Precision:
    """One module's precision decision (every field optional; `reason` says why, where a
    module was left out of a lower precision)."""

    param: str | None = None  # fp32 | bf16 | fp16: the dtype a data-parallel unit computes in
    reduce: str | None = None  # the dtype its gradients are reduced in
    offload: str | None = None  # "cpu": weights, gradients and optimizer state on the host
    autocast: str | None = None  # one data-parallel rank: the forward's autocast dtype
    fp8_recipe: str | None = None  # an FP8 linear: delayed | tensorwise | rowwise
    fp8_format: str | None = None  # hybrid | e4m3
    reason: str | None = None  # why a linear stays in high precision

    @property
    def compute_dtype(self) -> str | None:
        """The torch dtype name the module computes in (param or autocast), if set."""
        short = self.param or self.autocast
        return LONG.get(short) if short else None

    def __str__(self) -> str:
        if self.fp8_recipe:
            return f"fp8 {self.fp8_recipe} {self.fp8_format}"
        if self.reason:
            return f"bf16: {self.reason}"
        fields = {"param": self.param, "reduce": self.reduce, "offload": self.offload, "autocast": self.autocast}
        return " ".join(f"{key}={value}" for key, value in fields.items() if value)

    @classmethod
    def parse(cls, text: str) -> "Precision":
        """The decision `str(precision)` wrote (a saved layout's TOML)."""
        if text.startswith("fp8 "):
            _, recipe, form = text.split()
            return cls(fp8_recipe=recipe, fp8_format=form)
        if text.startswith("bf16: "):
            return cls(reason=text.removeprefix("bf16: "))
        return cls(**dict(item.split("=", 1) for item in text.split()))
