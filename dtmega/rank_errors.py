"""Every rank's error is heard: a rank that stops on an input error says why where the launch
can see it, and the ranks waiting for it stop within seconds instead of at the timeout.

Before, only rank 0 printed errors ("every rank fails alike"). That is false for rank-local
faults: a node without the data, one rank's damaged RNG file, one node's full disk. The failing
rank exited 2 in silence, and rank 0 waited out --distributed-timeout-minutes (10 by default)
to point at logs that were empty, or died in a raw gloo "Connection closed by peer".

Now a rank that stops on a DtmegaError writes its one line into the launch's rendezvous store
(torchrun's agent store, or the one rank 0 hosts for a hand launch: `MASTER_ADDR:MASTER_PORT`),
under this restart attempt's key space, before it exits. Ranks waiting to join (joining.py)
poll those keys with the join keys and stop at once with the failed rank's message; a rank whose
collective broke because a peer exited looks there before printing a traceback. The store is
found from the launch's environment each time (no process-group state is kept here).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

FAILED = "dtmega/failed/"


def attempt_prefix() -> str:
    """The key space of this restart attempt (torchrun's agent store outlives restarts)."""
    return f"dtmega/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _launch_store(timeout: timedelta):
    """A client of the launch's store, or None outside a multi-rank launch or if it cannot be reached."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout, multi_tenant=True, wait_for_workers=False)
    except (RuntimeError, ValueError, OSError):
        return None
    return dist.PrefixStore(attempt_prefix(), store)


def report_failure(message: str, timeout: timedelta = timedelta(seconds=10)) -> bool:
    """Writes this rank's one-line error where the other ranks look (best effort); True if written.
    Under torchrun the agent hosts the store (always up); in a hand launch rank 0 would host it,
    so a rank 0 that stops before hosting has no one to tell (the others' join wait names it)."""
    rank = os.environ.get("RANK")
    hand_launched_host = rank == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = _launch_store(timeout) if rank is not None and not hand_launched_host else None
    if store is None:
        return False
    try:
        store.set(f"{FAILED}{rank}", message.splitlines()[0][:2000])
        return True
    except (RuntimeError, OSError):
        return False


def failed_ranks(store, world: int) -> dict[int, str]:
    """rank -> message of every rank that reported a failure into `store` (this attempt's prefix store)."""
    found = {}
    for rank in range(world):
        key = f"{FAILED}{rank}"
        if store.check([key]):
            found[rank] = store.get(key).decode(errors="replace")
    return found


def peers_failures(wait: float = 3.0) -> dict[int, str]:
    """The failures other ranks reported, looked up from a fresh client of the launch's store,
    waiting up to `wait` seconds for one to arrive (a peer writes before it exits)."""
    store = _launch_store(timedelta(seconds=5))
    if store is None:
        return {}
    world, own = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    deadline = time.monotonic() + wait
    while True:
        try:
            found = {rank: text for rank, text in failed_ranks(store, world).items() if rank != own}
        except (RuntimeError, OSError):
            return {}
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def describe(failures: dict[int, str]) -> str:
    """'rank 1: <its message>' for the first failed rank, and how many others failed."""
    rank = min(failures)
    more = len(failures) - 1
    return f"rank {rank} stopped: {failures[rank]}" + (f" (and {more} more rank{'s' * (more > 1)})" if more else "")
