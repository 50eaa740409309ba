"""The package's import graph (DESIGN.md §1, issue #28): which package may import which, read from
the source with ``ast`` (lazy imports inside functions count too)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparse_ops", "engine", "policies", "models", "pipelines", "nodes", "benchmarks", "demo")
# what each package must never import: the contract lives in the engine, kernels below everything
FORBIDDEN = {
    "sparse_ops": {"engine", "policies", "models", "pipelines", "nodes", "benchmarks", "demo"},
    "engine": {"policies", "models", "pipelines", "nodes", "benchmarks", "demo"},
    "policies": {"models", "pipelines", "nodes", "benchmarks", "demo"},
    "models": {"policies", "pipelines", "nodes", "benchmarks"},
    "pipelines": {"nodes", "benchmarks"},
}


def _imported_packages(path: Path) -> set[str]:
    """Top-level packages of this project that ``path`` imports (relative imports resolved)."""
    pkg_parts = path.relative_to(ROOT).parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg_parts[:len(pkg_parts) - (node.level - 1)] if node.level > 1 else pkg_parts
            target = (*base, *(node.module.split(".") if node.module else ()))
            if target:
                found.add(target[0])
            elif node.names:                                   # "from .. import x" at the root
                found.update(a.name for a in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for n in names:
                parts = n.split(".")
                if parts[0] == "sparsevar" and len(parts) > 1:
                    found.add(parts[1])
    return found & set(PACKAGES)


def import_graph() -> dict[str, set[str]]:
    graph = {p: set() for p in PACKAGES}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            graph[pkg] |= _imported_packages(f) - {pkg}
    return graph


def test_no_package_imports_what_it_must_not():
    graph = import_graph()
    assert set(graph["sparse_ops"]) == set() and "engine" in graph["policies"] and "sparse_ops" in graph["engine"]
    bad = {pkg: sorted(graph[pkg] & banned) for pkg, banned in FORBIDDEN.items() if graph[pkg] & banned}
    assert bad == {}, f"forbidden imports: {bad}"


# the demo trainer saves its result as a pipeline folder (a lazy import in demo/train.py), while
# VARPipeline.from_demo reads the shipped folder's path from demo/__init__.py: the one edge left out
CYCLE_EXEMPT = {("demo", "pipelines")}


def test_the_package_graph_has_no_cycle():
    graph = import_graph()
    for a, b in CYCLE_EXEMPT:
        assert b in graph[a], f"{a} no longer imports {b}: drop the exemption"
        graph[a] = graph[a] - {b}
    seen, stack = set(), []

    def visit(p):
        assert p not in stack, f"import cycle: {' → '.join(stack[stack.index(p):] + [p])}"
        if p in seen:
            return
        stack.append(p)
        for q in sorted(graph[p]):
            visit(q)
        stack.pop()
        seen.add(p)

    for p in PACKAGES:
        visit(p)


if __name__ == "__main__":
    for pkg, deps in import_graph().items():
        print(f"{pkg:11s} → {', '.join(sorted(deps)) or '(nothing)'}")


def test_every_subpackage_is_listed_in_pyproject():
    """A wheel (non-editable install) carries only the packages pyproject.toml lists."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"sparsevar"} | {"sparsevar." + ".".join(p.parent.relative_to(ROOT).parts)
                             for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert found == listed, f"not listed: {sorted(found - listed)}; listed but missing: {sorted(listed - found)}"
