"""Which way the imports go (docs/architecture.md), read from the source, imports inside
functions included: a lazy import hides a cycle from Python, not from the design."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elasticrun"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> list[tuple[str, str | None, bool]]:
    """(module, imported name or None, at module level) for every import in module ``name``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            for alias in node.names:
                if f"{module}.{alias.name}" in MODULES:  # from package import module
                    found.append((f"{module}.{alias.name}", None, id(node) in top))
                else:
                    found.append((module, alias.name, id(node) in top))
    return found


def _deps(name: str, module_level_only: bool = False) -> set[str]:
    return {m for m, _, top in _imports(name) if m in MODULES and m != name and (top or not module_level_only)}


def _cycle(modules: set[str]) -> list[str] | None:
    """A cycle among ``modules`` (imports inside functions count), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(_deps(m) & modules):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(modules):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_in_the_driver():
    assert _cycle({m for m in MODULES if m.startswith("elasticrun.driver.")}) is None


def test_the_layers():
    for name in MODULES:
        deps = _deps(name)
        if name.startswith("elasticrun.common"):
            assert all(d.startswith("elasticrun.common") for d in deps), (name, deps)
        elif name.startswith("elasticrun.discovery"):
            assert all(d.startswith(("elasticrun.common", "elasticrun.discovery")) for d in deps), (name, deps)
        elif name.startswith("elasticrun.worker"):
            assert not any(d.startswith(("elasticrun.driver", "elasticrun.discovery")) for d in deps), (name, deps)
        elif name.startswith("elasticrun.driver"):
            assert not any(d.startswith("elasticrun.worker") for d in deps), (name, deps)
            # --check imports torch inside a function to report on it; nothing else does.
            assert not any(m.split(".")[0] == "torch" for m, _, top in _imports(name) if top), name


def test_the_driver_loop_imports_nothing_of_ssh_and_no_one_imports_the_bootstrap():
    assert "elasticrun.driver.ssh" not in _deps("elasticrun.driver.driver")
    assert not any("elasticrun.driver.remote_bootstrap" in _deps(m) for m in MODULES)  # it is sent as text


@pytest.mark.parametrize("layer", ["elasticrun.common", "elasticrun.discovery", "elasticrun.driver",
                                   "elasticrun.api"])
def test_no_private_name_of_another_module_is_imported(layer):
    private = [(name, module, what) for name in MODULES if name.startswith(layer)
               for module, what, _ in _imports(name)
               if module.startswith("elasticrun") and what and what.startswith("_") and not what.startswith("__")]
    assert not private
