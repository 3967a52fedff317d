"""The systems `benchmarks/gpu_step.py` times, each set up the way its maintainers document it.

Every system trains the same Llama (fp32 master weights, bf16 compute, AdamW with the same
hyper-parameters) and returns a `step(tokens, labels)` that does forward, backward and the
optimizer step. A step is timed by the caller; what a peer's kernels receive is recorded in
`Setup.notes` and asserted by tests/unit/test_benchmark_peers.py.

  plain               the unsharded model, autocast bf16, each block compiled, fused AdamW, the
                      logits' cross entropy in fp32
  plain+liger         the same, with Liger-Kernel's fused linear cross entropy called as its
                      docs call it: OUTSIDE autocast, on bf16 hidden states and a bf16 copy of
                      the output weight made once per step (the fp32 master weight gets the
                      gradient through the cast). Called inside autocast on fp32 tensors (the
                      old benchmark), every chunk re-cast the 1 GiB weight and the weight
                      gradient accumulated in fp32: ~84 GB more memory traffic per step.
  plain+float8        torchao float8 training: `Float8LinearConfig.from_recipe_name(recipe)` and
                      torchao's own module filter for that recipe (`_auto_filter_for_recipe`,
                      the output layer named in filter_fqns), converted before compiling
  plain+liger+float8  both
  torchtitan          torchtitan 0.3.0's Llama 3 (its `1B` flavor, untied to match: dim 2048,
                      16 blocks, 32/8 heads, FFN 8192, vocab 128256; its flex attention), its per-block compile,
                      autocast bf16 (its one-device mixed precision), fused AdamW
  torchtitan+float8   + its Float8LinearConverter as its own config registry sets it for
                      Llama 3 (rowwise, filter_fqns ["lm_head"]); tensorwise is not a recipe
                      torchtitan 0.3.0 offers for dense linears
  dtmega              parallelize + DataParallel("fsdp", bf16) + Compile (one rank: autocast)
  dtmega+kernels      + FuseKernels() (the fused loss; norms, SwiGLU, RoPE where faster)
  dtmega+fp8          + Float8(recipe)
  dtmega+kernels+fp8  both

torchtitan's own Trainer needs a tokenizer and a dataset on disk (none on the lent machine);
these runs take its model, converter, compile and optimizer settings under this script's loop,
which feeds every system the same fresh random batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

RECIPES = ("tensorwise", "rowwise")  # float8 systems run both; the faster counts
TITAN_RECIPES = ("rowwise",)


@dataclass(frozen=True)
class System:
    """One way to train the model: which stack, which pieces on."""

    name: str
    stack: str  # plain | torchtitan | dtmega
    liger: bool = False
    float8: bool = False
    kernels: bool = False

    @property
    def needs(self) -> tuple[str, ...]:
        """Packages it imports (a system whose package is missing is reported, not run)."""
        needs = {"liger_kernel"} if self.liger else set()
        if self.float8 and self.stack != "dtmega":
            needs.add("torchao")
        if self.stack == "torchtitan":
            needs.add("torchtitan")
        return tuple(sorted(needs))

    @property
    def recipes(self) -> tuple[str | None, ...]:
        """The float8 recipes it runs (None: no float8)."""
        if not self.float8:
            return (None,)
        return TITAN_RECIPES if self.stack == "torchtitan" else RECIPES

    @property
    def precision(self) -> str:
        """bf16 or fp8: which peer stack it is compared with."""
        return "fp8" if self.float8 else "bf16"


SYSTEMS = {s.name: s for s in (
    System("plain", "plain"),
    System("plain+liger", "plain", liger=True),
    System("plain+float8", "plain", float8=True),
    System("plain+liger+float8", "plain", liger=True, float8=True),
    System("torchtitan", "torchtitan"),
    System("torchtitan+float8", "torchtitan", float8=True),
    System("dtmega", "dtmega"),
    System("dtmega+kernels", "dtmega", kernels=True),
    System("dtmega+fp8", "dtmega", float8=True),
    System("dtmega+kernels+fp8", "dtmega", kernels=True, float8=True),
)}


@dataclass
class Setup:
    """A built system: its step and what was set up (recorded in the results)."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    notes: dict = field(default_factory=dict)
    model: torch.nn.Module | None = None  # what the step trains (tests look inside)


def model_config(tiny: bool):
    """The benchmark's Llama: 1.50 B (untied), or a tiny one for the CPU."""
    from dtmega.models import LlamaConfig

    if tiny:
        return LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512, max_seq_len=256,
                           rope_scaling=None)
    return LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                       max_seq_len=2048, tie_embeddings=False)


def build(system: System, recipe: str | None, config, device: str, backend: str) -> Setup:
    """The system's step for `config` on `device` (blocks compiled with `backend`; "none":
    eager, for tests that look inside the blocks)."""
    builders = {"plain": _plain, "torchtitan": _torchtitan, "dtmega": _dtmega}
    return builders[system.stack](system, recipe, config, device, backend)


# ---- plain PyTorch (+ Liger, + torchao) -------------------------------------------------------
def liger_loss(weight_bf16: torch.Tensor, hidden_bf16: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Liger's fused linear cross entropy as its docs call it: bf16 inputs, outside autocast."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    with torch.autocast(hidden_bf16.device.type, enabled=False):
        return LigerFusedLinearCrossEntropyLoss()(weight_bf16, hidden_bf16, labels)


def torchao_float8(model: torch.nn.Module, recipe: str) -> dict:
    """torchao float8 training with the recipe's config and torchao's own filter for it; returns
    what was converted."""
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    keep = _auto_filter_for_recipe(recipe, filter_fqns=["output"])
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    converted = sorted(name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear")
    return {"float8_recipe": recipe, "float8_filter": "torchao._auto_filter_for_recipe(filter_fqns=['output'])",
            "float8_converted": len(converted)}


@contextlib.contextmanager
def _without_output(model):
    """The model returns its final (normed) hidden states for the duration."""
    output, model.output = model.output, None
    try:
        yield
    finally:
        model.output = output


def _plain(system: System, recipe: str | None, config, device: str, backend: str) -> Setup:
    from dtmega.models import Llama

    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    notes = {"autocast": "bfloat16", "optimizer": "AdamW(fused)" if device == "cuda" else "AdamW(foreach)"}
    if system.float8:
        notes.update(torchao_float8(model, recipe))
    for block in model.layers.values() if backend != "none" else ():
        block.compile(backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  fused=device == "cuda")
    autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if system.liger:
            with autocast(), _without_output(model):
                hidden = model(tokens)
            weight = model.output.weight.to(torch.bfloat16)  # one bf16 copy per step
            loss = liger_loss(weight, hidden.to(torch.bfloat16).flatten(0, 1), labels.flatten())
        else:
            with autocast():
                loss = F.cross_entropy(model(tokens).float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if system.liger:
        notes["liger"] = "LigerFusedLinearCrossEntropyLoss(weight bf16, hidden bf16) outside autocast"
    return Setup(step, notes, model)


# ---- torchtitan -------------------------------------------------------------------------------
def torchtitan_config(tiny: bool, recipe: str | None, compiled: bool):
    """torchtitan's Llama 3 config: `1B` untied (the benchmark's size) or `debugmodel`, with its
    float8 converter applied as its docs configure it."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel" if tiny else "1B"](attn_backend="flex")  # torchtitan's default
    if getattr(config, "enable_weight_tying", False):
        config = dataclasses.replace(config, enable_weight_tying=False)
    if tiny:  # flex attention has no backward on the CPU: SDPA, as the suite's torchtitan models
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if recipe is not None:
        from torchtitan.components.quantization import Float8LinearConverter

        cpu = not torch.cuda.is_available()  # FP8 GEMMs need SM89+: emulated (eager only) on the CPU
        # as torchtitan's own config registry sets it for Llama 3 (llama3_405b_float8): rowwise,
        # the output layer left out. (Its "auto_filter_small_kn" hands torchao's module filter a
        # Linear.Config instead of a module in 0.3.0, so it would convert nothing.)
        converter = Float8LinearConverter(Float8LinearConverter.Config(
            recipe_name=recipe, filter_fqns=["lm_head"], model_compile_enabled=compiled and not cpu, emulate=cpu))
        config = converter.convert(config)
    return config


def _torchtitan(system: System, recipe: str | None, config, device: str, backend: str) -> Setup:
    tiny = config.dim < 1024
    compiled = backend != "none" and not (tiny and system.float8)  # its emulated FP8 (CPU) refuses torch.compile
    titan = torchtitan_config(tiny, recipe, compiled)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = titan.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    if compiled:
        for name, block in model.layers.named_children():  # torchtitan's apply_compile: each block
            model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  fused=device == "cuda")
    vocab = titan.vocab_size  # the tiny debugmodel's 2048 differ from the tiny config's: ids are folded in

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if vocab != config.vocab_size:
            tokens, labels = tokens % vocab, labels % vocab
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    notes = {"autocast": "bfloat16", "compiled_blocks": compiled, "float8_recipe": recipe,
             "float8_converted": converted, "model": "torchtitan llama3 " + ("debugmodel" if tiny else "1B untied")}
    return Setup(step, notes, model)


# ---- dtmega -----------------------------------------------------------------------------------
def _dtmega(system: System, recipe: str | None, config, device: str, backend: str) -> Setup:
    import dtmega
    from dtmega.models import Llama
    from dtmega.passes import Compile, DataParallel, Float8, FuseKernels, Plan
    from dtmega.train.optim import adamw

    with torch.device("meta"):
        model = Llama(config)
    passes = [FuseKernels()] if system.kernels else []
    if system.float8:
        passes.append(Float8(recipe=recipe, format="e4m3" if recipe == "rowwise" else "hybrid",
                             min_features=1024 if config.dim >= 1024 else 16))
    passes += [DataParallel("fsdp", param_dtype="bfloat16")] + ([Compile(backend)] if backend != "none" else [])
    pm = dtmega.parallelize(model, dtmega.make_mesh(dp_shard=1, device_type=device), Plan(passes))
    pm.init_weights(seed=0)
    optimizer = adamw(pm.module, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = pm.forward_backward(dtmega.make_batch(tokens, labels))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pm.after_optimizer_step()  # the plan's post-step hooks (FP8 scales)
        return loss

    kernels = sorted({e.kernel for e in pm.layout.modules.values() if e.kernel})
    return Setup(step, {"plan": [type(p).__name__ for p in passes], "kernels": kernels, "float8_recipe": recipe},
                 pm.module)
