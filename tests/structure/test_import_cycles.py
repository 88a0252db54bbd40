"""No import circle anywhere in moescale/: every import statement (module level and inside
functions) is read from the source, relative ones resolved, and the graph of modules must have
no cycle. A test of the reader itself makes sure it finds circles and function-level imports."""

from __future__ import annotations

from import_graph import build_graph, cycles


def describe(graph, component: list[str]) -> str:
    inside = set(component)
    return "; ".join(f"{a} -> {b} (line {graph.edges[a][b]})"
                     for a in component for b in sorted(graph.edges[a]) if b in inside)


def test_moescale_has_no_import_circle():
    graph = build_graph()
    assert len(graph.modules) > 100      # the whole package was read
    found = cycles(graph)
    assert not found, "import circles: " + " | ".join(describe(graph, c) for c in found)


def test_the_reader_sees_function_level_and_relative_imports(tmp_path):
    import import_graph
    pkg = tmp_path / "moescale"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import thing\n")
    (pkg / "c.py").write_text("import moescale.sub.a as a\nthing = 1\n")
    root = import_graph.ROOT
    import_graph.ROOT = tmp_path
    try:
        graph = build_graph(pkg)
    finally:
        import_graph.ROOT = root
    assert graph.edges["moescale.sub.a"] == {"moescale.sub.b": 2}
    assert graph.edges["moescale.sub.b"] == {"moescale.c": 1}
    assert cycles(graph) == [["moescale.c", "moescale.sub.a", "moescale.sub.b"]]
