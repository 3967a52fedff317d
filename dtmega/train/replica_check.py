"""When `dtmega train` compares the copies of replicated weights (dtmega/replicas.py): at the
start and every --check-weight-hash-across-dp-replicas-interval steps, or after every step with
--test-mode, as Megatron checks its data-parallel replicas."""

from __future__ import annotations

from typing import Any

from dtmega.replicas import check_replicas


def check_replicas_when_due(args: Any, pm, iteration: int, *, start: bool = False) -> None:
    """Runs the replica check if this point of the run is one the flags ask for (collective:
    every rank reaches the same points)."""
    interval = args.check_weight_hash_across_dp_replicas_interval
    due = args.test_mode or (interval is not None and (start or iteration % interval == 0))
    if due:
        check_replicas(pm)
