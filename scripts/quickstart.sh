#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct), from a fresh machine:
# set up, fetch the model and data, answer a prompt with speculative decoding, check losslessness.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/lightning-spec assets
.venv/bin/lightning-spec generate --drafter self --tree chain:4 --max-new-tokens 48 \
  --prompt "Give me three tips for writing clear code."
