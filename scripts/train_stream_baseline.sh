#!/usr/bin/env bash
# Train the streamed baseline (configs/train/eagle3_stream_cpu.yaml; CONFIG=... for another recipe
# whose run folder is runs/<its name>), or resume it: the run folder lives in the asset cache so
# that a later session (whose work tree is new) continues from its last checkpoint, with the
# RunBudget's spent seconds carried in that checkpoint. Extra arguments go to `fit`.
# BUDGET_MINUTES=N gives the whole run (all its sessions) N minutes instead of the config's: a
# resumed run with a larger budget refits its cosine schedule to the time that is left.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/train/eagle3_stream_cpu.yaml}
NAME=$(basename "$CONFIG" .yaml)
CACHE=${LIGHTNING_SPEC_CACHE:-$HOME/.cache/lightning-spec}
mkdir -p "$CACHE/runs/$NAME" runs
if [ ! -L "runs/$NAME" ]; then
  if [ -e "runs/$NAME" ]; then
    echo "runs/$NAME exists and is not a link to $CACHE/runs/$NAME: move it away first" >&2
    exit 2
  fi
  ln -s "$CACHE/runs/$NAME" "runs/$NAME"
fi
bash scripts/setup.sh
if [ -n "${BUDGET_MINUTES:-}" ]; then
  # the config with RunBudget's `minutes:` replaced (no other key of the configs is `minutes:`)
  sed -E "s/^([[:space:]]*minutes:).*/\1 ${BUDGET_MINUTES}/" "$CONFIG" > "runs/$NAME/budget.yaml"
  CONFIG="runs/$NAME/budget.yaml"
fi
RESUME=()
if [ -f "runs/$NAME/checkpoints/last.ckpt" ]; then RESUME=(--ckpt_path last); fi
echo "$(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo -) fit --config $CONFIG ${RESUME[*]} $*" \
  >> "$CACHE/runs/$NAME/COMMANDS"
exec .venv/bin/lightning-spec fit --config "$CONFIG" "${RESUME[@]}" "$@"
