"""The parallelism section of `dtmega train`'s arguments: TP/SP, CP, data parallelism, EP, recompute, compile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dtmega.passes import (
    Compile,
    ContextParallel,
    DataParallel,
    ExpertParallel,
    Pass,
    Recompute,
    SequenceParallel,
    TensorParallel,
)
from dtmega.train.arg_fields import ArgumentError
from dtmega.train.arg_fields import opt as _opt

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ParallelArgs:
    """How the run is split over ranks (pipelines apart): TP/SP, CP, data parallelism, EP, recompute, compile,
    --auto-plan."""
    # sizes and counts that must be >= 1 when given (None: derive it)
    at_least_one: ClassVar[tuple[str, ...]] = ("tensor_model_parallel_size", "microbatches", "context_parallel_size",
        "data_parallel_shard_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "recompute_num_layers", "num_distributed_optimizer_instances")

    tensor_model_parallel_size: int = _opt(1, "TP size")
    microbatches: int | None = _opt(None, "micro-batches per step (default: global batch / micro batch / DP)")
    context_parallel_size: int = _opt(1, "CP size: every sequence split over this many ranks")
    cp_comm_type: str = _opt("p2p", "context-parallel attention: p2p (ring), all_gather, a2a (Ulysses); a2a+p2p "
                                    "(hierarchical) is not supported yet", ("p2p", "all_gather", "a2a", "a2a+p2p"))
    sequence_parallel: bool = _opt(False, "sequence parallelism (needs TP > 1)")
    tp_comm_overlap: bool = _opt(False, "overlap TP communication with the GEMMs (not supported yet)")
    use_distributed_optimizer: bool = _opt(False, "shard optimizer state over data-parallel ranks (FSDP)")
    data_parallel: str | None = _opt(None, "ddp, fsdp or hsdp (default: fsdp with --use-distributed-optimizer, else ddp)",
                                     ("ddp", "fsdp", "hsdp"))
    num_distributed_optimizer_instances: int = _opt(1, "with --use-distributed-optimizer: N copies of the sharded "
                                                         "optimizer, each sharding over data-parallel size / N ranks "
                                                         "(= --data-parallel hsdp --data-parallel-shard-size DP/N)")
    use_torch_fsdp2: bool = _opt(False, "Megatron's switch to PyTorch FSDP2: = --data-parallel fsdp")
    grad_reduce_in_bf16: bool = _opt(False, "reduce gradients across data-parallel ranks in bf16 (default fp32)")
    data_parallel_shard_size: int | None = _opt(None, "ranks each HSDP replica shards over (with --data-parallel hsdp)")
    expert_model_parallel_size: int = _opt(1, "EP size: experts split over this many of the data-parallel ranks")
    expert_tensor_parallel_size: int | None = _opt(None, "ETP size: TP (each expert's hidden dim split, the "
                                                         "default) or 1 (experts whole, spread over EP ranks that take "
                                                         "in TP, Megatron's MoE parallel folding)")
    cpu_optimizer: bool = _opt(False, "keep fp32 weights, gradients and Adam state on the host and step there "
                                      "(FSDP2's CPU offload; implies --data-parallel fsdp unless hsdp is given)")
    cpu_optimizer_type: str = _opt("ADAM", "the host optimizer (AdamW, as on the device)", ("ADAM", "adam"))
    auto_plan: bool = _opt(False, "choose TP, PP, CP, data parallelism, micro-batch, recompute and --cpu-optimizer "
                                  "with the cost model (dtmega plan) for this world size")
    hardware: str | None = _opt(None, "with --auto-plan: h100, h200, a100, b200 or a `dtmega calibrate` file "
                                      "(default: the GPU found; required on a CPU)")
    recompute_granularity: str | None = _opt(None, "activation recompute", ("full", "selective"))
    recompute_activations: bool = _opt(False, "Megatron's short form of --recompute-granularity selective")
    recompute_method: str | None = _opt(None, "which blocks under full recompute", ("uniform", "block"))
    recompute_num_layers: int | None = _opt(None, "blocks per recompute unit (uniform) or recomputed blocks (block)")
    compile: str | None = _opt(None, "torch.compile backend for the blocks (inductor, aot_eager)")

    def split_passes(self, shape: Any, n_layers: int) -> list[Pass]:
        """The passes that split the model within a data-parallel replica (TP, SP, CP, EP) and
        recompute, in plan order; `shape` is the run's RunShape."""
        passes: list[Pass] = []
        etp = self.expert_tensor_parallel_size
        whole_experts = etp == 1 and bool(self.num_experts)  # type: ignore[attr-defined]  # ETP 1
        if shape.tp > 1:
            passes.append(TensorParallel(expert_hidden=not whole_experts))
        if self.sequence_parallel and shape.tp > 1:  # at TP 1 Megatron turns it off with a warning (plan_notes)
            passes.append(SequenceParallel())
        if shape.cp > 1:
            method = {"p2p": "ring", "all_gather": "all_gather", "a2a": "a2a"}[self.cp_comm_type]
            passes.append(ContextParallel(method=method))
        if etp is not None and shape.world % (etp * shape.expert_parallel * shape.pp):  # Megatron's expert-group check
            raise ArgumentError(
                f"--expert-tensor-parallel-size {etp}: the world of {shape.world} ranks is not a multiple of ETP x EP x "
                f"PP = {etp * shape.expert_parallel * shape.pp} (Megatron builds its expert groups over the whole "
                "world). Fix: launch a multiple of it, or leave --expert-tensor-parallel-size unset (= TP)"
            )
        if shape.ep > 1 or shape.expert_fold > 1:
            fold = ("tp",) if shape.expert_fold > 1 else ()
            passes.append(ExpertParallel(dispatcher=self.moe_token_dispatcher_type, fold=fold))  # type: ignore[attr-defined]
        return passes + self._recompute_passes(n_layers)

    def _recompute_passes(self, n_layers: int) -> list[Pass]:
        if self.recompute_activations and self.recompute_granularity == "full":
            raise ArgumentError("--recompute-activations (selective) and --recompute-granularity full disagree. Fix: "
                                "keep one")
        if self.recompute_granularity == "selective" or self.recompute_activations:
            return [Recompute("selective")]
        if self.recompute_granularity == "full":
            if self.recompute_method == "block":
                return [Recompute("full", first=self.recompute_num_layers or n_layers)]
            return [Recompute("full")]  # uniform, one block per unit (groups of several blocks were refused)
        # --recompute-num-layers 1 is Megatron's default value, which it ignores without full recompute
        if self.recompute_method or self.recompute_num_layers not in (None, 1):
            raise ArgumentError("--recompute-method/--recompute-num-layers need --recompute-granularity full")
        return []

    def data_parallel_mode(self) -> str:
        """ddp unless the optimizer is to be sharded (--use-distributed-optimizer) or a mode is given
        (--data-parallel, or Megatron-FSDP's sharding strategy)."""
        megatron_fsdp = self.megatron_fsdp_mode()  # type: ignore[attr-defined]
        if self.num_distributed_optimizer_instances > 1:
            if not self.use_distributed_optimizer and megatron_fsdp is None:
                raise ArgumentError(f"--num-distributed-optimizer-instances {self.num_distributed_optimizer_instances} "
                                    "copies the distributed optimizer: it needs --use-distributed-optimizer")
            if self.data_parallel not in (None, "hsdp"):
                raise ArgumentError(f"--num-distributed-optimizer-instances {self.num_distributed_optimizer_instances} "
                                    f"is hybrid sharding (hsdp) and --data-parallel says {self.data_parallel}. Fix: keep "
                                    "one")
            return "hsdp"
        if self.data_parallel:
            if self.use_torch_fsdp2 and self.data_parallel == "ddp":
                raise ArgumentError("--use-torch-fsdp2 and --data-parallel ddp disagree. Fix: keep one")
            if megatron_fsdp and megatron_fsdp != self.data_parallel:
                raise ArgumentError(f"--use-megatron-fsdp (--data-parallel-sharding-strategy) asks for {megatron_fsdp} "
                                    f"and --data-parallel for {self.data_parallel}. Fix: keep one")
            return self.data_parallel
        if megatron_fsdp:
            return megatron_fsdp
        return "fsdp" if self.use_distributed_optimizer or self.cpu_optimizer or self.use_torch_fsdp2 else "ddp"

    def data_parallel_passes(self, param_dtype: str) -> list[Pass]:
        """DataParallel in the chosen mode (gradients reduced in fp32), then Compile if asked."""
        mode = self.data_parallel_mode()
        if self.cpu_optimizer and mode == "ddp":
            raise ArgumentError("--cpu-optimizer keeps each rank's shard of the weights, gradients and Adam state on "
                                "the host, which needs sharded data parallelism. Fix: --data-parallel fsdp (or hsdp), "
                                "or drop --data-parallel ddp")
        in_bf16 = self.grad_reduce_in_bf16 or self.megatron_fsdp_grad_comm_dtype == "bf16"  # type: ignore[attr-defined]
        reduce_dtype = "bfloat16" if in_bf16 else "float32"
        passes: list[Pass] = [DataParallel(mode, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                           offload=self.cpu_optimizer)]
        if self.compile:
            passes.append(Compile(backend=self.compile))
        return passes
