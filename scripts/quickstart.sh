#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct), from a fresh machine:
# set up, fetch the model and data, train an EAGLE-3 drafter
# (configs/train/eagle3_quickstart_cpu.yaml: a 6-minute budget for the feature cache and
# training; about 12 minutes end to end on 2 CPU cores from an empty cache), bench it on 20
# MT-Bench prompts against HF greedy `generate` (as loaded and on the same optimised target) and
# HF prompt lookup, and print tau, speedup, the MLflow run and the drafter folder.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=runs/quickstart
# The tree is chosen for this machine (--tree auto: measured cost curve x the drafter's measured
# acceptance) and the target's and drafter's linear weights are prepacked for oneDNN, the CPU
# fast path (experiments/cpu-speed/LOG.md has the profile); QUICKSTART_TREE=dynamic:6,10,32
# QUICKSTART_PREPACK= for the earlier default.
TREE="${QUICKSTART_TREE:-auto}"
PREPACK="${QUICKSTART_PREPACK-"--prepack"}"
# HF generate as a user runs it and, when prepacked, HF generate on the same optimised target.
METHODS=hf_generate,hf_prompt_lookup,speculative
if [ -n "$PREPACK" ]; then METHODS=hf_generate,hf_generate_optimized,hf_prompt_lookup,speculative; fi
bash scripts/setup.sh
.venv/bin/lightning-spec assets
if [ -e "$RUN" ]; then
  # A second quickstart starts afresh; the previous one is kept beside it.
  mv "$RUN" "$RUN.$(date +%Y%m%d-%H%M%S)"
fi
.venv/bin/lightning-spec fit --config configs/train/eagle3_quickstart_cpu.yaml
.venv/bin/lightning-spec bench --drafter "$RUN/drafter/last" --dataset mtbench --limit 20 \
  --max-new-tokens 24 --tree "$TREE" $PREPACK --methods "$METHODS" \
  --no-progress --output "$RUN/bench.json" > /dev/null
.venv/bin/python -m lightning_spec.cli.quickstart_report "$RUN" "$RUN/bench.json"
