#!/usr/bin/env bash
# The test command: set up (once), then run the whole suite on one pytest-xdist worker per CPU
# (at most 4; `-n 0` after it runs in one process). Tests of a file that share a module-scoped
# fixture stay on one worker (--dist loadgroup, tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Let Python cache compiled modules and pytest its rewritten test files (__pycache__, ignored by
# git) where the environment says not to: every run's workers would rewrite the ~120 test
# files again (~1.5 s each before its first test).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup "$@"
