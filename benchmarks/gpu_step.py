"""One GPU, one model, every way to train it: tokens/s, MFU and peak memory in one run.

    python benchmarks/gpu_step.py                 # the 1.50 B Llama on one GPU (table + JSON)
    python benchmarks/gpu_step.py --tiny          # a tiny model on the CPU: checks the script

Llama 1.50 B (dim 2048, 16 layers, 32 heads / 8 KV, FFN 8192, vocab 128256 untied), seq 2048,
micro-batch 8, bf16, every block compiled with inductor, 10 timed steps after 4 warm-up; model
FLOPs = 6N + 12 L d S per token, MFU against 989 TFLOP/s (H100 dense bf16). Runs, each in its
own process (`torchrun --nproc-per-node 1`, so dtmega's runs use nccl):

  plain            a plain PyTorch script: autocast bf16, fused AdamW
  plain+liger      the same with Liger-Kernel's fused linear cross entropy (if liger_kernel imports)
  plain+float8     the same with torchao float8 training, tensorwise (if torchao imports)
  plain+liger+float8
  dtmega           parallelize + DataParallel("fsdp", bf16) + Compile, fused AdamW, no fused kernels
  dtmega+loss      the same + the fused loss only (FuseKernels(rms_norm=False, swiglu=False, rope=False))
  dtmega+kernels   the same + FuseKernels() (fused loss, norms, SwiGLU, RoPE)
  dtmega+fp8       dtmega + Float8(recipe="tensorwise") (dtmega's own FP8 linears)
  dtmega+kernels+fp8
  *+fp8-delayed    delayed scaling (Megatron's default: amax history 1024, max) instead of tensorwise;
  *+fp8-rowwise    rowwise scaling (e4m3); not in the default set, name them with --runs
  *-mb16           micro-batch 16 (what the fused loss's memory makes room for)

Peers are compared, never imported by dtmega. Ratios are against the best peer of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
# Appended, not prepended: where dtmega is installed as a wheel (a GPU machine), the source
# tree's dtmega/ (without passes/ and kernels/, which the wheel nests) must not shadow it.
sys.path.append(str(ROOT))

from benchmarks.common import machine  # noqa: E402
from dtmega.printing import console  # noqa: E402

PEAK = 989e12
RUNS = ["plain", "plain+liger", "plain+float8", "plain+liger+float8", "dtmega", "dtmega+loss", "dtmega+kernels",
        "dtmega+fp8", "dtmega+kernels+fp8", "plain+liger-mb16", "dtmega+kernels-mb16"]


def model_config(tiny: bool):
    from dtmega.models import LlamaConfig

    if tiny:
        return LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512, max_seq_len=256,
                           rope_scaling=None)
    return LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                       max_seq_len=2048, tie_embeddings=False)


def _available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _plain_step(name: str, config, device: str, backend: str):
    """A plain script: the unsharded model, autocast, compiled blocks, fused AdamW."""
    from dtmega.models import Llama

    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    liger = "liger" in name
    if "float8" in name:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "output")
    for block in model.layers.values():
        block.compile(backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    loss_fn = None
    if liger:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss()
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

    def step(tokens, labels):
        with autocast:
            if liger:
                output, model.output = model.output, None
                hidden = model(tokens)
                model.output = output
                loss = loss_fn(model.output.weight, hidden.flatten(0, 1), labels.flatten())
            else:
                loss = F.cross_entropy(model(tokens).float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _dtmega_step(name: str, config, device: str, backend: str):
    """dtmega: parallelize on a one-rank mesh, the trainer's AdamW (fused on GPUs)."""
    import dtmega
    from dtmega.models import Llama
    from dtmega.passes import Compile, DataParallel, Float8, FuseKernels, Plan
    from dtmega.train.optim import adamw

    with torch.device("meta"):
        model = Llama(config)
    passes = [FuseKernels()] if "kernels" in name else []
    if "+loss" in name:
        passes = [FuseKernels(rms_norm=False, swiglu=False, rope=False)]
    if "+fp8" in name:
        recipe = name.rsplit("-", 1)[1] if name.endswith(("-delayed", "-rowwise")) else "tensorwise"
        passes.append(Float8(recipe=recipe, format="e4m3" if recipe == "rowwise" else "hybrid",
                             min_features=1024 if device == "cuda" else 16))
    passes += [DataParallel("fsdp", param_dtype="bfloat16" if device == "cuda" else "float32"), Compile(backend)]
    pm = dtmega.parallelize(model, dtmega.make_mesh(dp_shard=1, device_type=device), Plan(passes))
    pm.init_weights(seed=0)
    optimizer = adamw(pm.module, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)

    def step(tokens, labels):
        loss = pm.forward_backward(dtmega.make_batch(tokens, labels))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pm.after_optimizer_step()  # the plan's post-step hooks (delayed scaling's amax histories)
        return loss

    return step


def worker(name: str, tiny: bool, out: Path) -> None:
    """One run (under torchrun --nproc-per-node 1): timed steps, tokens/s, peak memory."""
    from dtmega.mesh import default_device_type, init_distributed
    from dtmega.models.llama_specs import llama_flops_per_token

    device = default_device_type()
    init_distributed(device)
    config = model_config(tiny)
    seq, batch = (64, 2) if tiny else (2048, 8)
    if name.endswith("-mb16"):
        batch, name = batch * 2, name[: -len("-mb16")]
    steps, warmup = (3, 1) if tiny else (10, 4)
    backend = "inductor" if device == "cuda" else "aot_eager"
    make = _dtmega_step if name.startswith("dtmega") else _plain_step
    step = make(name, config, device, backend)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator).to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for _ in range(warmup):
        step(inputs, labels)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(inputs, labels)
    loss = float(loss)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_s = batch * seq / seconds
    flops = llama_flops_per_token(config, seq) * tokens_per_s
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    out.write_text(json.dumps({"tokens_per_s": tokens_per_s, "mfu": flops / PEAK, "peak_gib": peak,
                               "step_s": seconds, "loss": loss, "micro_batch": batch}))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=RUNS, help="which runs (default: every one whose peers import)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on whatever device there is (checks the script)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_step.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.tiny, args.worker_out)
        return {}
    needs = {"liger": "liger_kernel", "float8": "torchao"}
    runs = [r for r in args.runs if all(_available(pkg) for key, pkg in needs.items() if key in r)]
    skipped = sorted(set(args.runs) - set(runs))
    rows = {}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    for name in runs:
        out = args.out.with_name(f"{args.out.stem}.{name}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        command = [torchrun, "--nproc-per-node", "1", str(Path(__file__).resolve()), "--worker", name,
                   "--worker-out", str(out), *(["--tiny"] if args.tiny else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))}
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
            failure = [line for line in done.stderr.splitlines() if "Error" in line and "ChildFailedError" not in line]
            rows[name] = json.loads(out.read_text()) if done.returncode == 0 else {
                "error": "\n".join(failure[-5:]) or done.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            rows[name] = {"error": f"timed out after {args.timeout} s"}
        console().print(f"{name}: {rows[name] if 'error' not in rows[name] else rows[name]['error'][-600:]}")
    peers = [r for name, r in rows.items() if name.startswith("plain") and "tokens_per_s" in r
             and not name.endswith("mb16")]
    best = max((r["tokens_per_s"] for r in peers), default=float("nan"))
    table = Table(title=f"one GPU, {'tiny model' if args.tiny else 'Llama 1.50 B, seq 2048'}: tokens/s, MFU of 989 "
                        "TFLOP/s, peak memory; ratio to the best peer of the run at micro-batch 8")
    for column in ("run", "micro-batch", "tokens/s", "MFU", "peak GiB", "x best peer"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for name, r in rows.items():
        if "error" in r:
            table.add_row(name, "", "error", "", "", "")
            continue
        table.add_row(name, str(r["micro_batch"]), f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f} %",
                      f"{r['peak_gib']:.1f}", f"{r['tokens_per_s'] / best:.3f}")
    console().print(table)
    if skipped:
        console().print(f"not run (peer not installed): {', '.join(skipped)}")
    result = {"command": " ".join(sys.argv), "machine": machine(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
