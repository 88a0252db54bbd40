"""`tomllib` on Python 3.11+, its backport `tomli` (same API) on 3.10.

moescale supports Python >= 3.10 (pyproject.toml), but `tomllib` joined the standard library in
3.11; pyproject.toml requires `tomli` on older versions. Every reader of TOML imports
`tomllib` from here (tests/test_python_versions.py checks that none imports it directly).
"""

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

__all__ = ["tomllib"]
