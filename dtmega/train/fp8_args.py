"""The FP8 section of `dtmega train`'s arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dtmega.passes import (
    Float8,
    Pass,
)
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class FP8Args:
    """FP8 training (the Float8 pass; docs/fp8.md)."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("fp8_amax_history_len",)
    # counts, rates and coefficients where 0 means none but a negative value means nothing
    at_least_zero: ClassVar[tuple[str, ...]] = ("fp8_min_features", "fp8_margin", "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16")

    fp8_format: str | None = _opt(None, "train the blocks' linears in FP8: e4m3 everywhere, or hybrid (e4m3 forward, "
                                        "e5m2 gradients)", ("e4m3", "hybrid"))
    fp8_hybrid: bool = _opt(False, "= --fp8-format hybrid")
    fp8_recipe: str = _opt("delayed", "FP8 scaling", ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"))
    fp8_amax_history_len: int = _opt(1, "delayed scaling: steps of amax history")
    fp8_margin: int = _opt(0, "scale-factor margin, as a power of 2 (only 0 is supported)")
    fp8_amax_compute_algo: str = _opt("most_recent", "delayed scaling: scale from the history's max or its newest",
                                      ("max", "most_recent"))
    fp8_param_gather: bool = _opt(False, "FSDP all-gathers the weights in FP8 (delayed or tensorwise scaling; needs "
                                         "--use-distributed-optimizer)")
    fp8_min_features: int = _opt(1024, "where nothing is measured (no GPU, --fp8-precision size): linears with "
                                       "fewer input or output features stay bf16 (FP8 loses there)")
    fp8_precision: str = _opt("auto", "each projection's precision: measured FP8 against bf16 at its per-rank shape "
                                      "on the GPU (measure; auto: where a GPU is), or by --fp8-min-features (size)",
                              ("auto", "measure", "size"))
    first_last_layers_bf16: bool = _opt(False, "keep the first and last blocks in bf16 under FP8")
    num_layers_at_start_in_bf16: int = _opt(1, "with --first-last-layers-bf16: blocks at the start kept bf16")
    num_layers_at_end_in_bf16: int = _opt(1, "with --first-last-layers-bf16: blocks at the end kept bf16")
    transformer_impl: str = _opt("local", "local: dtmega's modules (FP8 by its own kernels); transformer_engine: "
                                          "FP8 linears by Transformer Engine; inference_optimized (Megatron's "
                                          "inference layers) is not supported", ("local", "transformer_engine",
                                                                                  "inference_optimized"))

    def fp8_passes(self) -> list[Pass]:
        """The Float8 pass Megatron's --fp8-* flags describe (none without --fp8-format/--fp8-hybrid).
        The backend: Transformer Engine with --transformer-impl transformer_engine, else dtmega's own
        FP8 linear (which also gathers FSDP shards in FP8 with --fp8-param-gather); torchao's
        Float8Linear is the Python API's `Float8(backend="torchao")`."""
        fmt = "hybrid" if self.fp8_hybrid else self.fp8_format
        if fmt is None:
            given = [f"--{n.replace('_', '-')}" for n in ("fp8_param_gather", "first_last_layers_bf16")
                     if getattr(self, n)]
            if given:
                raise ArgumentError(f"{', '.join(given)} need(s) FP8: add --fp8-format hybrid (or --fp8-hybrid)")
            return []
        if self.fp8_hybrid and self.fp8_format not in (None, "hybrid"):
            raise ArgumentError(f"--fp8-hybrid and --fp8-format {self.fp8_format} disagree; give one of them")
        keep = self.first_last_layers_bf16
        return [Float8(recipe=self.fp8_recipe, format=fmt,
                       backend="transformer_engine" if self.transformer_impl == "transformer_engine" else "dtmega",
                       amax_history_len=self.fp8_amax_history_len, amax_compute_algo=self.fp8_amax_compute_algo,
                       param_gather=self.fp8_param_gather, min_features=self.fp8_min_features,
                       measure={"auto": None, "measure": True, "size": False}[self.fp8_precision],
                       first_blocks_bf16=self.num_layers_at_start_in_bf16 if keep else 0,
                       last_blocks_bf16=self.num_layers_at_end_in_bf16 if keep else 0)]
