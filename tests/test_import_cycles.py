"""No import cycles among the project's modules.

The graph is parsed from the source (ast), so it covers every import statement: module level, inside functions,
and under `if TYPE_CHECKING:` (a cycle through a type-only import is still a cycle a reader has to untangle).
`from a import b` counts as an edge to `a.b` when that is a module, else to `a`; relative imports are resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("decode_service", "common", "encoder_service", "inkling_kernels", "tools", "deploy", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules that `source` (module `name`) imports anywhere in its body."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {
        name: imports(path.read_text(), name, path.name == "__init__.py", set(files)) for name, path in files.items()
    }


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_the_parser_sees_type_checking_function_level_and_relative_imports():
    source = """
from typing import TYPE_CHECKING
from . import sibling
if TYPE_CHECKING:
    from pkg.typed import Thing
def f():
    import pkg.lazy.inner
"""
    modules = {"pkg.mod", "pkg.sibling", "pkg.typed", "pkg.lazy"}
    assert imports(source, "pkg.mod", False, modules) == {"pkg.sibling", "pkg.typed", "pkg.lazy"}


def test_cycle_finder_finds_a_cycle_through_three_modules():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles: {sorted(tuple(sorted(c)) for c in found)}"
