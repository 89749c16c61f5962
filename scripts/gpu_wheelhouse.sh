#!/usr/bin/env bash
# Fill .whl/ with the pure-Python wheels the GPU check carries to an image that lacks them
# (Lightning and its helpers; the check needs no MLflow, jsonargparse or omegaconf). Versions
# are the ones installed in .venv, so the GPU runs what the CPU suite tested. Pure-Python
# wheels install on any platform and Python 3.10+.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p .whl
for name in lightning lightning-utilities torchmetrics pytorch-lightning; do
  version="$("$PY" -c "from importlib.metadata import version; print(version('$name'))")"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "$name==$version"
done
ls -la .whl
