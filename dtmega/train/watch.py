"""Launch checks and hang diagnosis for a multi-rank run.

- `check_same_arguments`: before any work, every rank's arguments, plan and versions are
  compared through one all-gather of a digest; ranks launched differently (another config file
  on one node, another torch) are named with the settings that differ, on every rank alike.
- `RankMarks`: each rank writes where it is (step and phase) into the rendezvous store, a few
  bytes at each phase change. The store is a separate TCP service, so it still answers when a
  collective hangs: a rank whose collective times out reads everyone's marks and names the
  ranks that are elsewhere (still loading data at step 3, saving, gone), the phase it was in,
  and the mesh axes with this rank's peers on each. On gloo the timeout is a Python exception
  (`--distributed-timeout-minutes`); on nccl the watchdog ends the process with its own
  message, which names the operation (set TORCH_NCCL_TRACE_BUFFER_SIZE for its flight recorder).
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dtmega.joining import DistributedTimeout, minutes_text, rank_ranges
from dtmega.mesh import gather_objects
from dtmega.train.args import ArgumentError


def launch_settings(args_toml: dict, plan_toml: str) -> dict:
    """What must be equal on every rank: the arguments, the plan, the world and the versions."""
    import dtmega

    return {"args": args_toml, "plan": plan_toml, "world_size": dist.get_world_size(),
            "torch": torch.__version__, "dtmega": getattr(dtmega, "__version__", "?")}


def check_same_arguments(settings: dict, group=None) -> None:
    """Raises ArgumentError on every rank if the ranks' `settings` differ (one all-gather of a
    64-byte digest; the settings themselves are gathered only when they differ)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    digests = gather_objects(digest, group)
    if len(set(digests)) == 1:
        return
    everyone = gather_objects(settings, group)
    reference = _flatten(everyone[0])
    by_difference: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone):
        if digests[rank] == digests[0]:
            continue
        flat = _flatten(theirs)
        keys = sorted(set(flat) | set(reference), key=str)
        differences = [f"{key} = {flat.get(key, '(unset)')!r} (rank 0: {reference.get(key, '(unset)')!r})"
                       for key in keys if flat.get(key) != reference.get(key)]
        by_difference.setdefault("; ".join(differences[:5]) + (" ..." if len(differences) > 5 else ""), []).append(rank)
    lines = [f"rank{'s' * (len(ranks) > 1)} {rank_ranges(ranks)}: {difference}" for difference, ranks in by_difference.items()]
    raise ArgumentError(
        "the ranks were launched with different arguments, plans or versions; nothing ran:\n  " + "\n  ".join(lines)
        + "\nFix: launch every rank with the same command line, config file and environment (one torchrun/srun line "
        "on every node, the same installed packages)"
    )


def _flatten(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def looks_like_timeout(error: BaseException) -> bool:
    """Whether a backend error is a collective that waited out its timeout."""
    text = str(error).lower()
    return isinstance(error, (dist.DistBackendError, RuntimeError)) and ("timed out" in text or "timeout" in text)


_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe", "failed to recv, got 0 bytes",
              "connection refused")


def looks_like_a_lost_peer(error: BaseException) -> bool:
    """Whether a backend error is a peer that went away (killed, out of memory, its node lost)."""
    text = str(error).lower()
    return isinstance(error, (dist.DistBackendError, RuntimeError)) and any(words in text for words in _LOST_PEER)


class RankMarks:
    """Where this rank is, written to the rendezvous store; read back to explain a timeout."""

    def __init__(self, mesh, timeout_minutes: float):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh, self.timeout_minutes = mesh, timeout_minutes
        self.store = dist.distributed_c10d._get_default_store() if self.world > 1 else None
        self.keys = [f"dtmega/progress/{rank}" for rank in range(self.world)]  # the store is this attempt's (joining.py)
        self.step, self.phase = 0, "start-up"
        # every rank's wall clock at one moment (one all-gather, on every rank alike): a mark's
        # stamp is read on the reader's clock, so a node whose clock is an hour off does not show
        # a phase "for 3618 s" (matrix 3, T4)
        clocks = gather_objects(time.time())
        self.clock_offsets = [clock - clocks[self.rank] for clock in clocks]

    def mark(self, step: int, phase: str) -> None:
        """This rank is now at `step`, doing `phase` (one small store write)."""
        self.step, self.phase = step, phase
        if self.store is not None:
            self.store.set(self.keys[self.rank], json.dumps([step, phase, time.time()]))

    def where_everyone_is(self) -> list[str]:
        """'ranks 0-2: step 5, forward/backward' lines, from the store (ranks with no mark: 'no
        mark yet'). Reads with a short timeout: the store may be gone with its host."""
        if self.store is None:
            return []
        places: dict[str, list[int]] = {}
        for rank, key in enumerate(self.keys):
            try:
                if self.store.check([key]):
                    step, phase, stamp = json.loads(self.store.get(key))
                    since = time.time() - (stamp - self.clock_offsets[rank])
                    place = f"step {step}, {phase} (for {max(0.0, since):.0f} s)"
                else:
                    place = "no mark yet (not started, or crashed before its first step)"
            except (RuntimeError, ValueError):
                place = "unknown (the store did not answer)"
            places.setdefault(place, []).append(rank)
        return [f"rank{'s' * (len(r) > 1)} {rank_ranges(r)}: {place}" for place, r in places.items()]

    def peers(self) -> list[str]:
        """'tp (ranks 0, 1)' per mesh axis of size > 1: this rank's groups, where a collective waits."""
        names = self.mesh.mesh_dim_names or ()
        lines = []
        for name in names:
            if self.mesh[name].size() > 1:
                ranks = dist.get_process_group_ranks(self.mesh.get_group(name))
                lines.append(f"{name} (ranks {rank_ranges(sorted(ranks))})")
        return lines

    def explain(self, error: BaseException) -> DistributedTimeout:
        """The timeout `error`, with where this rank was, where every rank is, and the axes."""
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        return DistributedTimeout(
            f"rank {self.rank}: a collective timed out after {minutes_text(timedelta(minutes=self.timeout_minutes))} "
            f"(--distributed-timeout-minutes) at step {self.step}, in {self.phase}. Where the ranks are:\n  "
            + "\n  ".join(self.where_everyone_is())
            + f"\nThis rank's collectives run over: {', '.join(self.peers()) or 'the world'}. The backend said: {first}\n"
            "Fix: look at the logs of the ranks that are elsewhere (a hang or a crash there); a phase that is slow "
            "on purpose (a large save, slow storage) needs a larger --distributed-timeout-minutes"
        )

    def explain_lost_peer(self, error: BaseException) -> DistributedTimeout:
        """A collective broken by a peer that went away: where this rank was, where every rank
        is (from the store, if its host is alive), and what to do."""
        first = str(error).strip().splitlines()[0][:240] if str(error).strip() else type(error).__name__
        return DistributedTimeout(
            f"rank {self.rank}: the connection to a peer broke at step {self.step}, in {self.phase}: a rank or node of "
            "the job went away (killed, out of memory, a node failure). Where the ranks are:\n  "
            + "\n  ".join(self.where_everyone_is())
            + f"\nThe backend said: {first}\nFix: look at that node's logs; the checkpoints saved so far are intact: "
            "start the job again with --load (torchrun --max-restarts does so by itself)"
        )
