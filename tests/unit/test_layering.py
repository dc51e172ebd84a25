"""The import structure of elasticrun, read from the source (nothing is imported):

* no import cycles between elasticrun's modules, counting imports inside functions too (a
  lazy import that hides a cycle is still a cycle). A module's import of a package it is
  part of (``from elasticrun import __version__``) is no edge: Python imports every
  enclosing package before the module anyway;
* ``common`` imports neither the driver nor the worker; the worker never imports the driver
  (or discovery); the driver never imports the worker, nor torch at module level;
* no module of ``elasticrun/worker`` uses a private (underscore) name of another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "elasticrun"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(module: str, node: ast.ImportFrom | None = None, name: str | None = None) -> str:
    """The elasticrun module an import refers to (``from pkg import sub``: the submodule)."""
    if name is not None and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module


def imports(path: Path) -> list[tuple[str, ast.AST]]:
    """(elasticrun module imported, the node) for every import in ``path``, at any depth."""
    me = module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, node) for a in node.names if a.name.split(".")[0] == "elasticrun"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                pkg = me.split(".")[: len(me.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(pkg + ([node.module] if node.module else []))
            if base.split(".")[0] == "elasticrun":
                found += [(resolve(base, node, a.name), node) for a in node.names]
    return found


def graph() -> dict[str, set[str]]:
    return {m: {target for target, _ in imports(p) if target in MODULES and not (m + ".").startswith(target + ".")}
            for m, p in MODULES.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


#: Cycles known and left to their owners: the driver's CLI imports check.py, whose
#: functions import the CLI's parser back (driver code, changed on another branch).
KNOWN_CYCLES = [["elasticrun.driver.check", "elasticrun.driver.cli"]]


def test_no_import_cycles() -> None:
    edges = graph()
    assert "elasticrun.worker.collectives" in edges["elasticrun.worker.runtime"]  # the graph is real
    assert [c for c in cycles(edges) if c not in KNOWN_CYCLES] == []


def test_layers() -> None:
    bad = []
    for m, targets in graph().items():
        for t in targets:
            if m.startswith("elasticrun.common") and t.startswith(("elasticrun.worker", "elasticrun.driver")):
                bad.append((m, t))
            if m.startswith("elasticrun.worker") and t.startswith(("elasticrun.driver", "elasticrun.discovery",
                                                                  "elasticrun.api")):
                bad.append((m, t))
            if m.startswith("elasticrun.driver") and t.startswith("elasticrun.worker"):
                bad.append((m, t))
    assert bad == []
    for m, path in MODULES.items():
        if m.startswith(("elasticrun.driver", "elasticrun.discovery", "elasticrun.common")):
            tree = ast.parse(path.read_text(encoding="utf-8"))  # (--check probes torch in a function)
            torch = [n.lineno for n in tree.body if isinstance(n, ast.Import) and
                     any(a.name.split(".")[0] == "torch" for a in n.names)
                     or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch"]
            assert torch == [], f"{m} imports torch (lines {torch})"


def test_worker_modules_use_no_private_name_of_another_module() -> None:
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("elasticrun.worker"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}  # local name -> elasticrun module
        for target, node in imports(path):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name.startswith("_") and a.name != "__future__":
                        bad.append(f"{m}:{node.lineno} imports {a.name} from {target}")
                    if resolve(node.module or "", node, a.name) in MODULES and f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            else:
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and aliases[node.value.id] != m):
                bad.append(f"{m}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert bad == []
