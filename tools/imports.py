"""The import map of our packages: cycles, and which packages each package reaches.

    python tools/imports.py            # prints cycles (goal: none) and cross-package edges
    python tools/imports.py --json     # the same as data, for tests

Every `import` counts, at module level or inside a function: a lazy import hides a cycle
from Python, not from the reader who has to hold both modules in mind.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package name -> the folder that holds it
PACKAGES = {
    "trainium_api": ROOT / "api" / "trainium_api",
    "trainium_operator": ROOT / "operator" / "trainium_operator",
    "trainer": ROOT / "trainer",
}


def module_name(package: str, path: Path) -> str:
    rel = path.relative_to(PACKAGES[package]).with_suffix("")
    parts = [package, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(package, path)] = path
    return found


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` names or lies inside."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def graph() -> dict[str, set[str]]:
    known = modules()
    names = set(known)
    edges: dict[str, set[str]] = {name: set() for name in names}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base if is_package else base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
            for target in targets:
                hit = _resolve(target, names)
                if hit and hit != name and not name.startswith(hit + "."):
                    edges[name].add(hit)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_edges(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    out: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for src, targets in edges.items():
        for dst in targets:
            a, b = src.split(".")[0], dst.split(".")[0]
            if a != b:
                out[a].add(b)
    return {p: sorted(t) for p, t in out.items()}


def main() -> int:
    edges = graph()
    found = cycles(edges)
    report = {"cycles": found, "package_edges": package_edges(edges)}
    if "--json" in sys.argv:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{len(found)} import cycle(s)")
    for component in found:
        print(f"  {len(component)} modules: " + " ".join(component))
    for package, reaches in report["package_edges"].items():
        print(f"{package} imports: {', '.join(reaches) or 'nothing of ours'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
