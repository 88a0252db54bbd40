"""Python 3.10 support (pyproject.toml: requires-python >= 3.10): `tomllib` is 3.11+, so every
module reads TOML through moescale.toml_compat (tomli on 3.10), and pyproject.toml requires
tomli exactly where the standard library lacks tomllib."""

from __future__ import annotations

import re
from pathlib import Path

from moescale.toml_compat import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_no_module_imports_tomllib_directly():
    direct = re.compile(r"^\s*(import tomllib\b|from tomllib import)|__import__\(.tomllib.\)",
                        re.M)
    offenders = [str(p.relative_to(REPO)) for folder in ("moescale", "tests", "benchmarks",
                                                         "examples", "scripts")
                 for p in sorted((REPO / folder).rglob("*.py"))
                 if p.name != "toml_compat.py" and direct.search(p.read_text(encoding="utf-8"))]
    assert not offenders, ("import tomllib through moescale.toml_compat (tomli on Python "
                           f"3.10): {', '.join(offenders)}")


def test_pyproject_requires_tomli_below_3_11_only():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["requires-python"] == ">=3.10"
    tomli = [d for d in project["dependencies"] if re.match(r"tomli\b(?!-)", d)]
    assert len(tomli) == 1, project["dependencies"]
    requirement, _, marker = tomli[0].partition(";")
    assert requirement.replace(" ", "").startswith("tomli>=")
    assert marker.replace(" ", "").replace('"', "'") == "python_version<'3.11'"
