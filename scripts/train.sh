#!/usr/bin/env bash
# The main job: set up (once), then train the default model on the built-in corpus.
# Extra arguments go to `moescale train` (see `moescale train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moescale train "$@"
