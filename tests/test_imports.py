"""Dependencies flow one way: the contract at the bottom, ops and exporter above it, nothing in a cycle.

Walks the installed ``cim_int4`` package's source (every import statement, also those inside
functions; imports under ``if TYPE_CHECKING`` are for type checkers only and are skipped).
"""

from __future__ import annotations

import ast
from pathlib import Path

import cim_int4

ROOT = Path(cim_int4.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(["cim_int4", *parts])] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str) -> set[str]:
    """The package modules ``name`` imports (a ``from package import submodule`` counts as the submodule)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if not _type_checking(child):
                todo.append(child)
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("cim_int4")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("cim_int4"):
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {target}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(MODULES):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_walk_sees_the_package() -> None:
    # A walk that found nothing would pass every check below.
    assert {"cim_int4.contract", "cim_int4.exporter.api", "cim_int4.ops.session", "cim_int4.cli"} <= MODULES.keys()
    assert "cim_int4.contract" in GRAPH["cim_int4.exporter.quantize"]
    assert "cim_int4.ops.reference_backend" in GRAPH["cim_int4.ops.session"], "imports inside functions count"


def test_no_import_cycle() -> None:
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_ops_never_import_the_exporter() -> None:
    edges = [(m, n) for m, ns in GRAPH.items() if m.startswith("cim_int4.ops") for n in ns]
    assert [e for e in edges if e[1].startswith("cim_int4.exporter")] == []


def test_the_contract_is_a_leaf() -> None:
    assert GRAPH["cim_int4.contract"] == set()


def test_cycle_finder_finds_a_cycle() -> None:
    global GRAPH
    saved = GRAPH
    try:
        GRAPH = {**saved, "cim_int4.contract": {"cim_int4.exporter.quantize"}}
        assert _cycle() is not None
    finally:
        GRAPH = saved
