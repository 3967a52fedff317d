"""Reference training with megatron-core itself, on CPU/gloo: what Megatron-LM's pretrain_gpt.py and
megatron/training/training.py (core_v0.16.1, the tag of the installed megatron-core 0.16.1) do for the
flags given, step by step, so that `dtmega train` with the same flags and initial weights can be
compared with it iteration by iteration (loss, lr, grad norm) and sample by sample.

    torchrun --standalone --nproc-per-node N tests/megatron_core_train.py OUT_DIR [Megatron flags]

The flags are a subset of Megatron's, spelled as Megatron spells them, with Megatron's defaults:
data-parallel size = world / (tp * pp). The model is fixed (tests/megatron_core_gpt.py's: the
Megatron flags it stands for are written to OUT_DIR/meta.json). Writes:

    OUT_DIR/initial/iter_0000000   the weights before any step (dist_checkpointing, torch_dist)
    OUT_DIR/steps.json             per iteration (1-based): iteration, loss (train_step's: sum of
                                   loss sums / sum of loss tokens over the global batch), lr (as
                                   training_log logs it: after the scheduler's step, so the lr
                                   the next iteration uses), grad_norm (before clipping), skipped
    OUT_DIR/samples.json           per iteration: the train-dataset indices read (global order, and
                                   per data-parallel rank per micro-batch); for iterations 1-3 each
                                   sample's token sum, first 8 token ids and loss-token count
    OUT_DIR/meta.json              flags, world sizes, padded vocab, versions, dataset sizes, runtime
    OUT_DIR/cache/                 the GPTDataset/BlendedDataset index caches (.npy) Megatron built

Equivalent Megatron flags that are not options here: --use-cpu-initialization (weights are made
on the CPU: _initialize_affine_weight_cpu, whole then split, from torch's default generator),
--transformer-impl local, --tokenizer-type NullTokenizer (megatron.core.tokenizers' null library,
as pretrain_gpt's core_gpt_dataset_config_from_args builds it; eod = --vocab-size), fp32.

megatron-core 0.16.1 assumes CUDA where a CPU run reaches it; each replacement, for this process
only, changes where a tensor lives or skips a CUDA-only call, never a value:
1. `torch.cuda.current_device` returns "cpu": where buffers (DDP grad buffers, RoPE frequencies,
   p2p shape tensors) are allocated.
2. `torch.cuda.synchronize` is a no-op (p2p communication and the torch_dist writer call it);
   CPU ops and gloo collectives are synchronous.
3. `CudaRNGStatesTracker.fork` is a null context: it wraps attention dropout (0 here) and
   GPU-side weight init (not used: CPU initialization). Megatron's own _set_random_seed skips
   model_parallel_cuda_manual_seed when torch.cuda.device_count() == 0, as here, so the tracker
   holds no states and its fork would raise.
4. `_CudaTensorsOnCpu`, a TorchFunctionMode for the whole run: a tensor created with an explicit
   device="cuda" (scalar bookkeeping: the schedules' token counter, FP32Optimizer's loss scale
   1.0, clip_grads' norm accumulators and overflow buffers, the rerun state machine's flags) is
   created on the CPU instead, with the same dtype and value.
5. `clip_grad_by_total_norm_fp32` as the optimizer calls it asserts grad.type() ==
   'torch.cuda.FloatTensor'; it is called with use_decoupled_grad=True on `decoupled_grad`
   aliases of the same .grad tensors: the same function, same coefficient max_norm / (norm +
   1e-6), same in-place scaling of the same tensors; that branch only asserts fp32/bf16.
6. `torch.cuda.get_rng_state` returns an empty tensor and `torch.cuda.set_rng_state` does
   nothing: the rerun state machine (Megatron's default --rerun-mode validate_results) saves the
   RNG states before each forward-backward for a possible rerun; there is no CUDA generator, and
   the CPU generators (random, numpy, torch) are still saved and restored.
7. `Tensor.cuda()` returns the tensor itself: LanguageModule.setup_embeddings_and_output_layer
   moves the last pipeline stage's copy of a tied embedding to the GPU before the all-reduce that
   makes it equal to the first stage's (--gpt-blocks with PP); the all-reduce runs on the CPU.
What training.py does on GPU and this script does not: model_module.cuda() and the DDP side
stream (placement only), pin_memory and 2 DataLoader workers (prefetching only: the sampler
alone decides the order), and the TP broadcast of the empty cu_seqlens/max_seqlen (unused).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The model of tests/megatron_core_gpt.py, as the Megatron flags it stands for (meta.json).
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 128}
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
               "--num-query-groups", "2", "--ffn-hidden-size", "128", "--swiglu", "--normalization", "RMSNorm",
               "--norm-epsilon", "1e-5", "--position-embedding-type", "rope", "--rotary-base", "10000",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0",
               "--hidden-dropout", "0", "--init-method-std", "0.02", "--use-cpu-initialization",
               "--transformer-impl", "local", "--tokenizer-type", "NullTokenizer"]
# --gpt-blocks: Megatron's GPT blocks instead, as pretrain_gpt.py builds them without --swiglu (LayerNorm,
# learned absolute positions, biases, a 4 x hidden GeLU MLP, the output tied to the word embedding), with
# F.gelu (--no-bias-gelu-fusion) and dropout 0 (dropout masks are generator draws in Megatron)
GPT_FFN = 256
GPT_MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
                   "--num-query-groups", "2", "--ffn-hidden-size", str(GPT_FFN), "--normalization", "LayerNorm",
                   "--norm-epsilon", "1e-5", "--position-embedding-type", "learned_absolute", "--no-bias-gelu-fusion",
                   "--attention-dropout", "0", "--hidden-dropout", "0", "--init-method-std", "0.02",
                   "--use-cpu-initialization", "--transformer-impl", "local", "--tokenizer-type", "NullTokenizer"]
MIN_POSITIONS = 64
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron's default --make-vocab-size-divisible-by
CHECKSUM_ITERATIONS = 3


def build_parser() -> argparse.ArgumentParser:
    """Megatron's own flag names and defaults (megatron/training/arguments.py, training_config.py)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="OUT_DIR")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, help="default: micro-batch size x data-parallel size")
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear")
    p.add_argument("--lr-warmup-iters", type=int, default=0)
    p.add_argument("--lr-decay-iters", type=int)
    p.add_argument("--lr-wsd-decay-iters", type=int)
    p.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential")
    p.add_argument("--lr-warmup-init", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--start-weight-decay", type=float)
    p.add_argument("--end-weight-decay", type=float)
    p.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant")
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-path", nargs="*", required=True, help="a prefix, weight prefix pairs, or prefixes")
    p.add_argument("--split", help="default (Megatron's legacy): '969, 30, 1'")
    p.add_argument("--eod-mask-loss", action="store_true")
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--vocab-size", type=int, required=True, help="NullTokenizer: ids 0..N-1, eod N")
    p.add_argument("--gpt-blocks", action="store_true", help="Megatron's GPT blocks (GPT_MODEL_FLAGS), not Llama's")
    p.add_argument("--eval-iters", type=int, default=100)
    p.add_argument("--eval-interval", type=int, default=1000,
                   help="0.16.1 has no default (None, and get_train_valid_test_num_samples then fails); 1000 "
                        "is the default of 0.15")
    return p


def validate(a: argparse.Namespace, world: int) -> None:
    """The parts of arguments.py's validate_args these flags reach (derived sizes, asserts)."""
    a.data_parallel_size = world // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size)
    assert a.data_parallel_size * a.tensor_model_parallel_size * a.pipeline_model_parallel_size == world
    if a.global_batch_size is None:
        a.global_batch_size = a.micro_batch_size * a.data_parallel_size
    if a.split is None:
        a.split = "969, 30, 1"
    if a.weight_decay_incr_style == "constant":
        assert a.start_weight_decay is None and a.end_weight_decay is None
        a.start_weight_decay = a.end_weight_decay = a.weight_decay
    else:
        assert a.start_weight_decay is not None and a.end_weight_decay is not None
    assert a.min_lr <= a.lr
    assert MODEL["num_layers"] % a.pipeline_model_parallel_size == 0


def vocab_size_with_padding(vocab_size: int, tp: int) -> int:
    """megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding: up to a multiple of 128 x tp."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Patches 4 and 7 of the module docstring: an explicit device="cuda" becomes the CPU; .cuda() stays."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:  # patch 7: a tied embedding's last-stage copy moved "to the GPU" stays here
            return args[0]
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def patch_cuda_assumptions() -> None:
    """Patches 1-7 of the module docstring; each changes placement or skips a CUDA-only call."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    import megatron.core.optimizer.optimizer as megatron_optimizer
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    _CudaTensorsOnCpu().__enter__()
    clip = megatron_optimizer.clip_grad_by_total_norm_fp32

    def clip_on_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
        assert not use_decoupled_grad
        with_grad = [p for p in parameters if p.grad is not None]
        for p in with_grad:
            p.decoupled_grad = p.grad
        try:
            clip(with_grad, max_norm, total_norm, use_decoupled_grad=True)
        finally:
            for p in with_grad:
                del p.decoupled_grad

    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip_on_cpu


def set_random_seed(seed: int) -> None:
    """initialize.py _set_random_seed: seed + 100 x pipeline rank; CUDA seeding skipped without GPUs."""
    from megatron.core import parallel_state

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_model(a: argparse.Namespace, padded_vocab: int) -> tuple:
    """gpt_builders.gpt_builder with the local layer spec, then get_model's DDP wrapping (training.py
    get_model: DistributedDataParallelConfig from Megatron's defaults; bucket_size None since
    overlap_grad_reduce is off; grad_reduce_in_fp32 = --accumulate-allreduce-grads-in-fp32, off for
    fp32 params, whose grads are fp32 anyway; check_for_nan_in_grad on)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    block = dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False)
    sizes = MODEL
    if a.gpt_blocks:
        block = dict(gated_linear_unit=False, activation_func=F.gelu, normalization="LayerNorm", add_bias_linear=True)
        sizes = {**MODEL, "ffn_hidden_size": GPT_FFN}
    config = TransformerConfig(
        **sizes, **block,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size, layernorm_epsilon=1e-5, init_method_std=0.02,
        calculate_per_token_loss=a.calculate_per_token_loss, deallocate_pipeline_outputs=True,
        pipeline_dtype=torch.float32, batch_p2p_comm=True,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=block["normalization"]),
                     vocab_size=padded_vocab, max_sequence_length=max(MIN_POSITIONS, a.seq_length),
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), parallel_output=True,
                     share_embeddings_and_output_weights=a.gpt_blocks,
                     position_embedding_type="learned_absolute" if a.gpt_blocks else "rope",
                     rotary_percent=1.0, rotary_base=10000)
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, check_for_nan_in_grad=True,
                                               overlap_grad_reduce=False, use_distributed_optimizer=False,
                                               bucket_size=None, average_in_collective=False)
    return model, DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(a: argparse.Namespace, ddp_model) -> tuple:
    """setup_model_and_optimizer: get_megatron_optimizer_config's AdamOptimizerConfig (decoupled
    weight decay: torch.optim.AdamW without TE/Apex, FusedAdam adam_w_mode with them) and
    get_standard_config_overrides (no weight decay on biases and 1-D params), then
    get_optimizer_param_scheduler (training.py 1354-1407 at core_v0.16.1): iteration-based, steps
    counted in samples = iters x global batch."""
    from megatron.core.optimizer import AdamOptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = AdamOptimizerConfig(lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, adam_beta1=a.adam_beta1,
                                 adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.clip_grad,
                                 params_dtype=torch.float32, use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(config, [ddp_model], config_overrides=get_standard_config_overrides(config))
    lr_decay_iters = a.lr_decay_iters if a.lr_decay_iters is not None else a.train_iters
    wsd_decay_steps = a.lr_wsd_decay_iters * a.global_batch_size if a.lr_wsd_decay_iters is not None else None
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_iters * a.global_batch_size, lr_decay_steps=lr_decay_iters * a.global_batch_size,
        lr_decay_style=a.lr_decay_style, start_wd=a.start_weight_decay, end_wd=a.end_weight_decay,
        wd_incr_steps=a.train_iters * a.global_batch_size, wd_incr_style=a.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
        wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=a.lr_wsd_decay_style)
    return optimizer, scheduler


def is_dataset_built_on_rank() -> bool:
    """pretrain_gpt.is_dataset_built_on_rank: first or last pipeline stage, tensor rank 0."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()) and ps.get_tensor_model_parallel_rank() == 0


def build_train_dataset(a: argparse.Namespace, out: Path) -> tuple:
    """pretrain_gpt's core_gpt_dataset_config_from_args and train_valid_test_datasets_provider, with
    training.py get_train_valid_test_num_samples (3290-3320): train = iters x global batch, valid =
    (iters // eval_interval + 1) x eval_iters x global batch, test = eval_iters x global batch."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=a.vocab_size)
    config = GPTDatasetConfig(
        random_seed=a.seed, sequence_length=a.seq_length, blend=get_blend_from_list(a.data_path), blend_per_split=None,
        split=a.split, multiple_validation_sets=False, full_validation=False, num_dataset_builder_threads=1,
        path_to_cache=str(out / "cache"), mmap_bin_files=True, tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=a.eod_mask_loss, create_attention_mask=True,
        object_storage_cache_path=None, mid_level_dataset_surplus=0.005, allow_ambiguous_pad_tokens=False,
        fast_cache_load=False, sequences_per_dataset=None, defer_npy_index_mmap=False, context_parallel_size=1,
        data_parallel_size=a.data_parallel_size, sequence_parallel_size=0, hybrid_context_parallel=False)
    eval_iters = (a.train_iters // a.eval_interval + 1) * a.eval_iters
    sizes = [a.train_iters * a.global_batch_size, eval_iters * a.global_batch_size, a.eval_iters * a.global_batch_size]
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_dataset_built_on_rank, config).build()
    return tokenizer, train, sizes


class MegatronPretrainingSampler:
    """megatron/training/datasets/data_samplers.py MegatronPretrainingSampler (core_v0.16.1, lines
    96-162), dataloader_type 'single': consecutive indices from consumed_samples on; each chunk of
    micro_batch x dp indices gives this data-parallel rank its micro_batch slice; a last partial chunk
    is dropped. Every batch it yields is also kept in `record` (the sample order dtmega must match)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int):
        assert total_samples > 0 and consumed_samples < total_samples and data_parallel_rank < data_parallel_size
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.record: list[list[int]] = []

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                start = self.data_parallel_rank * self.micro_batch_size
                self.record.append(batch[start:start + self.micro_batch_size])
                yield batch[start:start + self.micro_batch_size]
                batch = []


BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, a: argparse.Namespace, seen: list[dict]) -> tuple:
    """pretrain_gpt.get_batch with utils.get_batch_on_this_tp_rank (utils.py 517-760): tensor rank 0
    reads the micro-batch and broadcasts what its pipeline stage needs to the other tensor ranks;
    middle stages read nothing. Rank 0's reads are checksummed into `seen`."""
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if not (first or last):
        return None, None, None, None, None
    if a.pipeline_model_parallel_size == 1:
        needed = BATCH_KEYS
    else:
        needed = ("tokens", "attention_mask", "position_ids") if first else ("labels", "loss_mask", "attention_mask")
    if ps.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {key: data[key] for key in BATCH_KEYS}
        tokens, mask = data["tokens"], data["loss_mask"]
        seen.append({"token_sum": tokens.sum(1).tolist(), "first_tokens": tokens[:, :8].tolist(),
                     "loss_tokens": mask.sum(1).int().tolist()})
    else:
        shape, seq = (a.micro_batch_size, a.seq_length), a.seq_length
        empty = {"tokens": torch.empty(shape, dtype=torch.int64), "labels": torch.empty(shape, dtype=torch.int64),
                 "loss_mask": torch.empty(shape, dtype=torch.float32),
                 "attention_mask": torch.empty((a.micro_batch_size, 1, seq, seq), dtype=torch.bool),
                 "position_ids": torch.empty(shape, dtype=torch.int64)}
        batch = {key: (empty[key] if key in needed else None) for key in BATCH_KEYS}
    for key in BATCH_KEYS:
        if key in needed:
            dist.broadcast(batch[key], ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
    return tuple(batch[key] for key in BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """pretrain_gpt.loss_func, 3-tuple: (loss summed over the loss mask, its token count, report
    [loss_sum, tokens]); with --check-for-nan-in-loss-and-grad (on by default) validated for NaN/Inf."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    machine = get_rerun_state_machine()
    for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
        machine.validate_result(result=loss, rejection_func=reject, message=f"found {what} in local forward loss calculation",
                                tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(a: argparse.Namespace, seen: list[dict], data_iterator, model) -> tuple:
    """pretrain_gpt.forward_step: the model's per-token losses and loss_func bound to the loss mask."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, a, seen)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def _model_parallel_reduce(value: float, op) -> float:
    """utils.py reduce_max_stat_across_model_parallel_group / logical_and_...: over tensor x pipeline."""
    from megatron.core import parallel_state

    stat = torch.tensor([value], dtype=torch.float32)
    dist.all_reduce(stat, op=op, group=parallel_state.get_model_parallel_group())
    return stat.item()


def train_step(a: argparse.Namespace, forward, data_iterator, model, optimizer, scheduler) -> dict[str, Any]:
    """training.py train_step (1603-1770 at core_v0.16.1), the parts a plain fp32 run reaches."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(data_iterator):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = get_forward_backward_func()(
            forward_step_func=forward, data_iterator=data_iterator, model=[model], num_microbatches=get_num_microbatches(),
            seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, decoder_seq_length=None, forward_only=False,
            adjust_tensor_shapes_fn=None, force_all_reduce=False)
    machine.should_checkpoint_and_exit()
    update_successful, grad_norm, _ = optimizer.step()
    update_successful = _model_parallel_reduce(1.0 if update_successful else 0.0, dist.ReduceOp.MIN) == 1.0
    grad_norm = _model_parallel_reduce(-1.0 if grad_norm is None else grad_norm, dist.ReduceOp.MAX)
    if update_successful:
        scheduler.step(increment=get_num_microbatches() * a.micro_batch_size * a.data_parallel_size)
    loss = None
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        val = torch.vstack([x["lm loss"].view(-1) for x in losses_reduced]).sum(dim=0)
        dist.all_reduce(val, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        loss = (val[0] / val[1]).item()
    return {"loss": loss, "grad_norm": None if grad_norm == -1.0 else grad_norm, "skipped": int(not update_successful)}


def save_initial(model: torch.nn.Module, out: Path) -> None:
    """The weights before any step, as Megatron saves them (torch_dist), for `dtmega convert megatron-to-dtmega
    --load OUT_DIR/initial/iter_0000000` (which needs no latest_checkpointed_iteration.txt)."""
    from megatron.core import dist_checkpointing

    path = out / "initial" / "iter_0000000"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(path))
    dist.barrier()


def samples_record(a: argparse.Namespace, num_microbatches: int, gathered: list) -> dict:
    """samples.json from every first-stage tensor-rank-0 rank's sampler record and checksums (the
    last stage's readers, under pipeline parallelism, must have read the same samples)."""
    per_rank = {r["dp"]: r for r in gathered if r["pp"] == 0 and r["tp"] == 0}
    for reader in gathered:
        if reader["indices"] is not None:
            assert reader["indices"] == per_rank[reader["dp"]]["indices"] and reader["seen"] == per_rank[reader["dp"]]["seen"]
    iterations = []
    for i in range(a.train_iters):
        window = slice(i * num_microbatches, (i + 1) * num_microbatches)
        ranks = {dp: per_rank[dp]["indices"][window] for dp in sorted(per_rank)}
        order = [idx for m in range(num_microbatches) for dp in sorted(ranks) for idx in ranks[dp][m]]
        entry: dict[str, Any] = {"iteration": i + 1, "indices": order, "per_dp_rank_micro_batches": ranks}
        if i < CHECKSUM_ITERATIONS:
            entry["samples"] = [
                {"index": idx, "token_sum": seen["token_sum"][k], "first_tokens": seen["first_tokens"][k],
                 "loss_tokens": seen["loss_tokens"][k]}
                for m in range(num_microbatches) for dp in sorted(ranks)
                for seen in [per_rank[dp]["seen"][i * num_microbatches + m]] for k, idx in enumerate(ranks[dp][m])]
        iterations.append(entry)
    return {"micro_batch_size": a.micro_batch_size, "data_parallel_size": a.data_parallel_size,
            "num_microbatches": num_microbatches, "iterations": iterations}


def write_json(path: Path, value: Any) -> None:
    """Rank 0 writes `value` to `path` (indented JSON)."""
    path.write_text(json.dumps(value, indent=1) + "\n")


def main(argv: list[str]) -> None:
    """Initialize as initialize_megatron does, build model/optimizer/data as pretrain() does, then
    run train()'s loop and record every step."""
    started = time.time()
    a = build_parser().parse_args(argv)
    out = Path(a.out)
    patch_cuda_assumptions()
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode, initialize_rerun_state_machine
    from torch.utils.data import DataLoader

    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    dist.init_process_group("gloo")
    validate(a, dist.get_world_size())
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(
        a.tensor_model_parallel_size, a.pipeline_model_parallel_size, order="tp-cp-ep-dp-pp",
        get_embedding_ranks=lambda pp_ranks, *rest: [pp_ranks[0]],  # pretrain_gpt.get_embedding_ranks, untied
        create_gloo_process_groups=True)
    init_num_microbatches_calculator(rank, None, a.global_batch_size, a.micro_batch_size, a.data_parallel_size)
    set_random_seed(a.seed)
    padded_vocab = vocab_size_with_padding(a.vocab_size + 1, a.tensor_model_parallel_size)  # NullTokenizer: N + eod
    gpt, model = build_model(a, padded_vocab)
    optimizer, scheduler = build_optimizer(a, model)
    tokenizer, train_ds, sizes = build_train_dataset(a, out)
    sampler, iterator = None, None
    if train_ds is not None:
        sampler = MegatronPretrainingSampler(len(train_ds), 0, a.micro_batch_size, parallel_state.get_data_parallel_rank(),
                                             a.data_parallel_size)
        iterator = RerunDataIterator(iter(DataLoader(train_ds, batch_sampler=sampler, num_workers=0)))
    save_initial(gpt, out)
    model.train()
    config = gpt.config
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    seen: list[dict] = []
    forward = partial(forward_step, a, seen)
    steps, training_started = [], time.time()
    for iteration in range(1, a.train_iters + 1):
        step = train_step(a, forward, iterator, model, optimizer, scheduler)
        step = {"iteration": iteration, **step, "lr": get_canonical_lr_for_logging(optimizer.param_groups)}
        steps.append(step)
        if rank == dist.get_world_size() - 1:
            print(f"iteration {iteration}/{a.train_iters} | lm loss {step['loss']:.6E} | lr {step['lr']:.6E} | "
                  f"grad norm {step['grad_norm']:.6f} | skipped {step['skipped']}", flush=True)
    gathered = [None] * dist.get_world_size()
    mine = {"dp": parallel_state.get_data_parallel_rank(), "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "tp": parallel_state.get_tensor_model_parallel_rank(), "indices": sampler.record if sampler else None,
            "seen": seen, "steps": steps, "train_len": len(train_ds) if train_ds is not None else None}
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        last = gathered[-1]["steps"]  # the last rank is on the last stage: it has the loss (print_rank_last)
        write_json(out / "steps.json", [{key: s[key] for key in ("iteration", "loss", "lr", "grad_norm", "skipped")}
                                        for s in last])
        write_json(out / "samples.json", samples_record(a, get_num_microbatches(), gathered))
        write_json(out / "meta.json", {
            "flags": [x for x in argv if x != a.out], "args": {k: v for k, v in vars(a).items() if k != "out"},
            "world_size": dist.get_world_size(), "tensor_model_parallel_size": a.tensor_model_parallel_size,
            "pipeline_model_parallel_size": a.pipeline_model_parallel_size, "data_parallel_size": a.data_parallel_size,
            "num_microbatches": get_num_microbatches(), "padded_vocab_size": padded_vocab,
            "tokenizer": {"kind": "megatron.core.tokenizers MegatronTokenizer, null library", "vocab_size": tokenizer.vocab_size,
                          "eod": tokenizer.eod},
            "model_flags": (GPT_MODEL_FLAGS if a.gpt_blocks else MODEL_FLAGS)
            + ["--max-position-embeddings", str(max(MIN_POSITIONS, a.seq_length))],
            "train_valid_test_num_samples": sizes, "train_dataset_length": gathered[0]["train_len"],
            "megatron_core": megatron.core.__version__, "torch": torch.__version__,
            "runtime_s": round(time.time() - started, 2), "setup_s": round(training_started - started, 2),
            "train_s": round(time.time() - training_started, 2)})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # the torch_dist writer's spawned helper re-imports this file
    # Ends normally (not os._exit): the torch_dist writer's spawned multiprocessing Manager is shut
    # down at exit; skipping that would leave it holding the caller's pipes open.
    main(sys.argv[1:])
