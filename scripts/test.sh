#!/usr/bin/env bash
# Set up (idempotent) and run the default test suite: everything but tests marked slow.
# Extra arguments go to pytest, e.g. `./scripts/test.sh -m slow` for the real-SmolLM2 tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
exec .venv/bin/python -m pytest -q "$@"
