"""The cost model: memory, FLOPs, bytes per collective and step time of a plan, per rank, and
the planner that ranks legal plans by predicted throughput (`dtmega plan`). docs/planning.md."""
