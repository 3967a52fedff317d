"""A pipeline schedule as a table: what every rank computes at every tick."""

from __future__ import annotations

from rich.table import Table

_STYLE = {"F": "green", "B": "red", "I": "magenta", "W": "blue"}


def _cell(action, multi_stage: bool) -> str:
    if action is None:
        return ""
    if action.sub_actions:  # an overlapped forward/backward pair (DualPipeV)
        return "+".join(_cell(a, multi_stage) for a in action.sub_actions)
    kind = action.computation_type.value
    text = f"{kind}{action.microbatch_index}" + (f"s{action.stage_index}" if multi_stage else "")
    return f"[{_STYLE.get(kind, 'white')}]{text}[/]"


def schedule_table(schedule, info) -> Table:
    """Rows are ticks, columns pipeline ranks; idle ticks are blank (the bubble)."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        raise RuntimeError(f"{type(schedule).__name__} exposes no action order to tabulate")
    multi = info.stages > len(set(info.rank_of_stage))
    compute = {rank: [a for a in actions if a is None or a.is_compute_op] for rank, actions in order.items()}
    ticks = max(len(actions) for actions in compute.values())
    table = Table(title=f"{info.schedule}: {info.stages} stages, F forward, B backward, I input-grad, W weight-grad")
    table.add_column("tick", justify="right")
    ranks = sorted(compute)
    for rank in ranks:
        table.add_column(f"rank {rank}", justify="center")
    padded = {rank: compute[rank] + [None] * (ticks - len(compute[rank])) for rank in ranks}
    for tick in range(ticks):
        table.add_row(str(tick), *(_cell(padded[rank][tick], multi) for rank in ranks))
    busy = [sum(a is not None for a in compute[r]) for r in compute]
    table.caption = f"idle ticks per rank: {[ticks - b for b in busy]} of {ticks}"
    return table
