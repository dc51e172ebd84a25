"""The package's structure, as docs/architecture.md describes it: imports go one way
(common <- discovery <- driver; common <- worker; the driver never imports torch), there is no
import cycle, and no module reaches into another's private (underscore) names."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PKG = Path(__file__).resolve().parents[2] / "elasticrun"


def modules() -> dict[str, Path]:
    found = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = p
    return found


MODULES = modules()


def imports(name: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import in module ``name``,
    at any depth (lazy imports inside functions count too)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [a.name for a in node.names]
            out.append((base, names, node.lineno))
            out += [(f"{base}.{n}", [], node.lineno) for n in names if f"{base}.{n}" in MODULES]
    return out


def internal(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in imports(m):
            t = internal(target)
            if t and t != m and t.startswith("elasticrun"):
                g[m].add(t)
    return g


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first walk of ``g`` meets (each as a closed path)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    return found


def test_the_checker_sees_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def reach(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for n in g.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def in_room(module: str, *rooms: str) -> bool:
    return any(module == f"elasticrun.driver.{r}" or module.startswith(f"elasticrun.driver.{r}.") for r in rooms)


def test_the_loop_reaches_nothing_of_launching_ssh_or_the_command_line():
    """The loop is handed its launcher (driver/launching.py says what it needs); the rooms that
    start processes, talk SSH or Ray, or read flags are not below it, not even transitively."""
    g = graph()
    for core in ("elasticrun.driver.driver", "elasticrun.driver.registry"):
        bad = sorted(m for m in reach(g, core) if in_room(m, "launch", "cli", "compose"))
        assert not bad, f"{core} reaches {bad}"
    assert "elasticrun.driver.launch.ssh" in reach(g, "elasticrun.driver.compose")  # the check can fail


def test_each_room_of_the_driver_looks_only_down():
    """cli/ composes everything; launch/ and durable/ serve the loop and never reach up into
    it or the command line; durable/ starts no process."""
    g = graph()
    bad = []
    for m, targets in g.items():
        if in_room(m, "launch"):
            bad += [f"{m} -> {t}" for t in targets if in_room(t, "cli", "compose", "driver", "durable")]
        if in_room(m, "durable"):
            bad += [f"{m} -> {t}" for t in targets if in_room(t, "cli", "compose", "driver", "launch")]
    assert not bad, bad


def test_no_one_imports_the_bootstrap():
    """It is sent as text and runs alone on the remote host. One exception: the local launcher
    takes its ``DeathNotice`` and its sweep of what a worker left behind (standard library
    only), so that the watcher's side of both is written once, for the local launcher and the
    remote watchdog alike."""
    g = graph()
    importers = sorted(m for m, targets in g.items() if "elasticrun.driver.launch.remote_bootstrap" in targets)
    assert importers in ([], ["elasticrun.driver.launch.local"])
    source = (PKG / "driver" / "launch" / "local.py").read_text()
    assert "from elasticrun.driver.launch.remote_bootstrap import DeathNotice, said_swept, sweep\n" in source


ALLOWED = {
    "common": {"common"},
    "discovery": {"common", "discovery"},
    "driver": {"common", "discovery", "driver"},
    "worker": {"common", "worker"},
}


def test_imports_go_one_way():
    bad = []
    for m, targets in graph().items():
        allowed = ALLOWED.get(layer(m))
        if allowed is None:
            continue  # the facades (torch.py, api.py, timeline, __main__) sit on top
        bad += [f"{m} -> {t}" for t in targets if layer(t) not in allowed]
    assert not bad, bad


def test_the_driver_never_imports_torch():
    bad = [f"{m}:{line}" for m in MODULES if layer(m) in ("common", "discovery", "driver")
           for target, _, line in imports(m) if target == "torch" or target.startswith("torch.")]
    assert not bad, bad


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for m in MODULES:
        for target, names, line in imports(m):
            if internal(target) and internal(target) != m:
                bad += [f"{m}:{line} imports {target}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, bad
