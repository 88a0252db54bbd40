"""Offloading tests import their shared model helpers (equivalence_models.py) from this folder.

(The whole suite runs torch on one intra-op thread: tests/conftest.py.)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
