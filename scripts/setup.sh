#!/usr/bin/env bash
# Create .venv (if missing) and install lightning-spec with its test tools.
# torch is pinned to the CPU build that these machines carry; on a GPU machine install the CUDA
# build of torch first (see docs/gpu.md) and this script keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install --quiet -e ".[dev]"
