"""Train a Llama with dtmega from a plain, torch.compile-driven script.

    torchrun --nproc-per-node 4 examples/train_llama.py              # TP2 x FSDP2 on CPU
    torchrun --nproc-per-node 4 examples/train_llama.py --tp 2 --cp 2 --cp-method ring --seq-len 256
    torchrun --nproc-per-node 4 examples/train_llama.py --model debug-moe --tp 1 --ep 2 --dispatcher alltoall
    torchrun --nproc-per-node 8 examples/train_llama.py --tp 4 --model llama3-8b --compile inductor

The data is synthetic but learnable: token streams from a fixed random Markov chain, so the
loss falls from ln(vocab) towards the chain's entropy.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

import dtmega
from dtmega.models import Llama, LlamaConfig
from dtmega.passes import Compile, ContextParallel, DataParallel, ExpertParallel, Plan, SequenceParallel, TensorParallel


def markov_batch(batch: int, seq: int, vocab: int, step: int, successors: int = 4) -> dict:
    """Token streams where each token is followed by one of `successors` fixed tokens."""
    table = torch.randint(0, vocab, (vocab, successors), generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(step)
    stream = torch.empty(batch, seq + 1, dtype=torch.long)
    stream[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    choice = torch.randint(0, successors, (batch, seq), generator=g)
    for t in range(seq):
        stream[:, t + 1] = table[stream[:, t], choice[:, t]]
    return dtmega.make_batch(stream[:, :-1], stream[:, 1:])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="debug", help="a LlamaConfig name: debug, llama3-8b, ...")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (the rest is FSDP)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: every sequence split over this many ranks")
    p.add_argument("--cp-method", default="ring", choices=["ring", "all_gather", "a2a"])
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models: debug-moe, mixtral-8x7b, ...)")
    p.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "allgather"], help="MoE token dispatch")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compile", default="aot_eager", help="torch.compile backend, or 'none'")
    p.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 master weights")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    """Trains and returns the loss of every step."""
    args = parse_args(argv)
    mesh = dtmega.make_mesh(tp=args.tp, cp=args.cp, ep=args.ep)
    config = LlamaConfig.from_name(args.model)
    with torch.device("meta"):
        model = Llama(config)
    plan = Plan([
        *([TensorParallel(), SequenceParallel()] if args.tp > 1 else []),
        *([ContextParallel(method=args.cp_method)] if args.cp > 1 else []),
        *([ExpertParallel(dispatcher=args.dispatcher)] if args.ep > 1 else []),
        DataParallel("fsdp", param_dtype="bfloat16" if args.bf16 else "float32"),
        *([Compile(backend=args.compile)] if args.compile != "none" else []),
    ])
    pm = dtmega.parallelize(model, mesh, plan)
    pm.init_weights(seed=0)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))

    leader = dist.get_rank() == 0
    console = dtmega.console()
    console.print(pm.report())
    console.print(f"{config.num_params():,} parameters. Loss starts near ln({config.vocab_size}) = "
                  f"{math.log(config.vocab_size):.2f} and can fall to the data's entropy, ln(4) = {math.log(4):.2f}")
    losses = []
    columns = [TextColumn("step {task.completed}/{task.total}"), BarColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not leader) as progress:
        task = progress.add_task("train", total=args.steps, loss="-")
        for step in range(args.steps):
            batch = markov_batch(args.batch_size, args.seq_len, config.vocab_size, step).to(mesh.device_type)
            optimizer.zero_grad()
            loss = pm.forward_backward(pm.shard_batch(batch))
            optimizer.step()
            pm.after_optimizer_step()  # the plan's post-step work: MoE expert bias, FP8 scales; else nothing
            schedule.step()
            losses.append(loss.item())
            progress.update(task, advance=1, loss=f"{losses[-1]:.3f}")
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
    dist.destroy_process_group()
