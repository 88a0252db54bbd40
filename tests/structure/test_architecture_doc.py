"""docs/architecture.md's import table is true: every package (and top-level module) of
moescale has a row, and the row names exactly what its files import of moescale (module level
and inside functions, read from the source by import_graph.py). The doc's rule that only some
packages communicate is checked the same way (no `torch.distributed` import elsewhere)."""

from __future__ import annotations

import ast
import re

from import_graph import PACKAGE, ROOT, build_graph

DOC = ROOT / "docs" / "architecture.md"
QUIET = ("layers", "routing", "dispatch", "offload", "models", "expert_state")


def unit(module: str) -> str:
    """`moescale.offload.engine` -> `offload`; `moescale.atomic` -> `atomic`; `moescale`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "moescale"


def actual_imports() -> dict[str, set[str]]:
    graph = build_graph()
    found = {unit(m): set() for m in graph.modules}
    for source, targets in graph.edges.items():
        found[unit(source)] |= {unit(t) for t in targets} - {unit(source)}
    return found


def documented_imports() -> dict[str, set[str]]:
    text = DOC.read_text()
    section = text[text.index("## 1. Packages and imports"):text.index("## 2.")]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \|.*\| ([^|]*) \|$", line)
        if not m:
            continue
        name, cell = m.groups()
        key = "moescale" if name == "__init__.py" else name.removesuffix("/").removesuffix(".py")
        cell = re.sub(r"\([^)]*\)", "", cell)
        names = {n.strip() for n in cell.split(",")} - {""}
        rows[key] = set() if names == {"nothing"} else names
    return rows


def test_every_package_has_a_row_naming_exactly_what_it_imports():
    doc, code = documented_imports(), actual_imports()
    assert set(doc) == set(code), (f"rows for packages that do not exist: {set(doc) - set(code)}; "
                                   f"packages without a row: {set(code) - set(doc)}")
    wrong = {name: {"doc": sorted(doc[name]), "code": sorted(code[name])}
             for name in code if doc[name] != code[name]}
    assert not wrong, f"docs/architecture.md's import table differs from the code: {wrong}"


def test_the_quiet_packages_never_import_torch_distributed():
    loud = []
    for package in QUIET:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if isinstance(node, ast.ImportFrom) and node.module == "torch":
                    names += [f"torch.{a.name}" for a in node.names]
                if any(n == "torch.distributed" or n.startswith("torch.distributed.")
                       for n in names):
                    loud.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not loud, f"torch.distributed imported where the doc says nothing communicates: {loud}"
