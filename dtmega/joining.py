"""Joining the job's world without hanging: every rank is waited for with the run's timeout
(Megatron's `--distributed-timeout-minutes`), and a rank that never arrives is named.

torch's own start-up either waits inside the process group's constructor (gloo and nccl connect
to every peer) and ends in a raw store or socket timeout, or, for a hand-launched job, in
"Timed out ... 1/2 clients joined" that says how many came but not which. Here the rendezvous
store is made first (`torch.distributed.rendezvous`, the same `env://` handling torchrun and
SLURM launches use), every rank writes its own key into it, and the ranks wait for all keys:
on a timeout the missing keys are the missing ranks. Only then is the process group built, on
that store, knowing every peer is there.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from dtmega.kernels.errors import DtmegaError
from dtmega.rank_errors import attempt_prefix, describe, failed_ranks

_PREFIX = "dtmega/joined/"


class PeerFailed(DtmegaError):
    """Another rank stopped on an input error (its message, as it reported it); this one stops too."""


class DistributedTimeout(RuntimeError):
    """Ranks did not meet within the timeout; the message names them and the fix. Raised on the
    ranks that waited (a missing rank cannot say anything), so every such rank prints it."""


def rank_ranges(ranks: list[int]) -> str:
    """'1, 3-5, 9' for [1, 3, 4, 5, 9]: rank lists in messages stay short at any scale."""
    spans, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            spans.append(f"{start}" if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(spans)


def minutes_text(timeout: timedelta) -> str:
    """'0.1 min' for a timeout, as --distributed-timeout-minutes spells it."""
    return f"{timeout.total_seconds() / 60:g} min"


def rendezvous(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) of this launch (`env://`: RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    as torchrun and SLURM scripts set them), after every rank has joined the store (under
    torchrun its agent's store, as `torch.distributed.rendezvous` gives it; otherwise one that
    rank 0 hosts without waiting in its constructor, so that the wait below can name ranks). Raises
    DistributedTimeout naming the ranks that did not join within `timeout`."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    fix = ("Fix: look at those ranks' logs (a crash or a hang before start-up), check that every node runs the same "
           "command and can reach MASTER_ADDR, or give slow starts more time with --distributed-timeout-minutes")
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun: its agent hosts the store
            store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        else:  # a hand or SLURM launch: rank 0 hosts it, and waits for the others below, by rank
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                                  timeout=timeout, multi_tenant=True, wait_for_workers=False)
    except (dist.DistStoreError, RuntimeError) as error:  # this rank cannot reach the store's host
        raise DistributedTimeout(
            f"rank {rank}: cannot reach the rendezvous at {address} (hosted by rank 0 or torchrun's agent) within "
            f"{minutes_text(timeout)}: {str(error).splitlines()[0].rstrip('.')}. {fix}"
        ) from None
    # torchrun's agent store outlives a restart (--max-restarts): the keys of the attempt before,
    # the process group's peer addresses among them, are still there. Each attempt gets its own
    # key space, or a restarted rank may connect to a dead peer's address.
    store = dist.PrefixStore(attempt_prefix(), store)
    keys = [f"{_PREFIX}{r}" for r in range(world)]
    store.set(keys[rank], "1")
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.05
    while True:  # polled (store.wait would log each short timeout): a rank that stopped on an error ends it at once
        if store.check(keys):
            return store, rank, world
        failures = failed_ranks(store, world)
        if failures:
            raise PeerFailed(f"{describe(failures)} (this rank, {rank}, was waiting for it to join)")
        if time.monotonic() >= deadline:
            break
        time.sleep(pause)
        pause = min(0.5, pause * 2)
    missing = [r for r in range(world) if not store.check([keys[r]])]
    raise DistributedTimeout(
        f"rank {rank}: rank{'s' * (len(missing) > 1)} {rank_ranges(missing)} of {world} did not join within "
        f"{minutes_text(timeout)} (--distributed-timeout-minutes). {fix}"
    )
