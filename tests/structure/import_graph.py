"""moescale's import graph, read from the source (no module is imported): every `import` and
`from ... import` statement of every file under moescale/, at module level and inside functions
or classes, relative imports resolved against the file's package. An edge a -> b means module a
names module b (a package's __init__ when the name is no submodule of it).

Used by the structure tests: no import circle (test_import_cycles.py) and the import table of
docs/architecture.md (test_architecture_doc.py). Deliberately not here: imports by string
(`importlib.import_module` of a name from a table, as cli.py does), which no test can read.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moescale"


@dataclass
class ImportGraph:
    """modules: dotted name -> file; edges: name -> {(target, line)} (targets are modules)."""

    modules: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, dict[str, int]] = field(default_factory=dict)

    def resolve(self, dotted: str) -> str | None:
        """The longest prefix of `dotted` that is a module of the package, or None."""
        while dotted:
            if dotted in self.modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None


def module_name(path: Path) -> tuple[str, bool]:
    """(dotted name, is a package __init__) of a file under the repository root."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imported_modules(node: ast.AST, package: str, graph: ImportGraph) -> set[str]:
    """The modules of the package one import statement names (`from x import a`: x.a when that
    is a submodule, else x)."""
    if isinstance(node, ast.Import):
        return {graph.resolve(alias.name) for alias in node.names} - {None}
    if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    found = set()
    for alias in node.names:
        full = f"{source}.{alias.name}"
        found.add(full if full in graph.modules else graph.resolve(source))
    return found - {None}


def build_graph(package: Path = PACKAGE) -> ImportGraph:
    graph = ImportGraph()
    infos = {}
    for path in sorted(package.rglob("*.py")):
        name, is_package = module_name(path)
        graph.modules[name] = path
        infos[name] = is_package
    for name, path in graph.modules.items():
        here = name if infos[name] else name.rpartition(".")[0]
        targets: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported_modules(node, here, graph) - {name}:
                targets.setdefault(target, node.lineno)
        graph.edges[name] = targets
    return graph


def cycles(graph: ImportGraph) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph.edges:
        if root in index:
            continue
        work = [(root, iter(graph.edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found
