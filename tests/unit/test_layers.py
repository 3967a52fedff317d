"""The three layers import downwards only, and nothing imports in a circle.

kernels/ (dtmega.kernels) imports nothing of ours; passes/ (dtmega.passes) imports kernels;
dtmega/ (models included) imports both (docs/architecture.md). Every import counts, the ones
inside functions too (a lazy import is still a dependency); the ones under `if TYPE_CHECKING:`
do not (they never run). Read from the source with `ast`, so the test needs no import side
effects. It found `passes/fusion_sites.py` importing dtmega's models and a five-module cycle
through `dtmega/cost` and `dtmega/train/metrics.py`, among others."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"dtmega.kernels": ROOT / "kernels", "dtmega.passes": ROOT / "passes", "dtmega": ROOT / "dtmega"}
RANK = {"dtmega.kernels": 0, "dtmega.passes": 1, "dtmega": 2}


def modules() -> dict[str, Path]:
    """Module name -> source file, for the three layers as installed."""
    found = {}
    for prefix, folder in LAYERS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([prefix, *parts])] = path
    return found


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for statement in node.body for child in ast.walk(statement)}
    return skipped


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours `path` imports (anywhere but under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_blocks(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return {name for name in found if name in known}


def layer(module: str) -> str:
    return next(prefix for prefix in ("dtmega.kernels", "dtmega.passes", "dtmega") if module.startswith(prefix))


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_imports_point_down_the_layers():
    upward = [f"{module} imports {target}" for module, targets in graph().items() for target in sorted(targets)
              if RANK[layer(target)] > RANK[layer(module)]]
    assert not upward, "\n".join(upward)


def test_no_module_imports_in_a_circle():
    assert not cycles(graph())


def test_the_checks_find_what_they_look_for():
    """The analysis is not vacuous: a planted upward import and a planted cycle are found."""
    edges = graph()
    assert len(edges) > 150 and sum(map(len, edges.values())) > 300
    assert "dtmega.kernels.registry" in edges["dtmega.passes.manager"]
    planted = {**edges, "dtmega.kernels.registry": edges["dtmega.kernels.registry"] | {"dtmega.passes.manager"}}
    assert ["dtmega.kernels.registry", "dtmega.passes.manager"] in cycles(planted)


def test_nothing_read_from_disk_is_unpickled_as_code():
    """A checkpoint is data (issue 31): DCP is read through dtmega/checkpoint_reader.py only
    (its restricted metadata unpickler and weights_only bytes), every `torch.load` says
    `weights_only=True`, and no module calls `pickle.load(s)`. A new reader elsewhere fails here."""
    offenders = []
    for name, path in modules().items():
        if name == "dtmega.checkpoint_reader":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            call = ast.unparse(node.func)
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if call in ("pickle.load", "pickle.loads", "FileSystemReader", "dcp.FileSystemReader") or (
                    call == "torch.load" and keywords.get("weights_only") != "True") or (
                    call == "dcp.load" and "DataOnlyLoadPlanner" not in keywords.get("planner", "")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not offenders, "reads that could unpickle code:\n" + "\n".join(offenders)
