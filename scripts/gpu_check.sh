#!/usr/bin/env bash
# The GPU check (lightning_spec/bench/gpu_check.py, docs/gpu.md): fit in bf16-mixed and 32-true,
# lossless decoding with and without the Triton kernels, Draft-OPD and GTO rollouts, ONNX
# export with onnxruntime parity, on a tiny target built in code; one JSON report.
#
#   bash scripts/gpu_check.sh OUT_DIR            # a GPU machine: CUDA steps, ~8 minutes at most
#   bash scripts/gpu_check.sh OUT_DIR --dry      # CPU, small sizes (the default suite runs this)
#
# It works on a bare image that has torch, transformers and triton but not this package: what is
# missing comes from the wheelhouse in .whl/ (scripts/gpu_wheelhouse.sh fills it; pure-Python
# wheels only) and this checkout is installed into a temporary folder, nothing system-wide.
# PYTHON names the interpreter (default python3, or .venv/bin/python when it exists);
# GPU_CHECK_TIMEOUT the wall-clock limit in seconds (default 480).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR [--dry]}"
shift
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
SITE="$(mktemp -d /tmp/gpu-check-site.XXXXXX)"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

missing() {  # the modules of "$@" this interpreter cannot import
  "$PYTHON" - "$@" <<'PY'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
PY
}

need="$(missing lightning torchmetrics lightning_utilities)"
if [ -n "$need" ]; then
  if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    echo "gpu_check: installing $need from .whl/ into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$SITE" "$ROOT"/.whl/*.whl
  else
    echo "gpu_check: missing $need and no wheelhouse (.whl/, scripts/gpu_wheelhouse.sh);" \
      "the steps that need them report skipped" >&2
  fi
fi
if [ -n "$(missing lightning_spec.export)" ]; then
  echo "gpu_check: installing this checkout (no dependencies) into $SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --target "$SITE" "$ROOT" >"$OUT/install.log" 2>&1 || {
      cat "$OUT/install.log" >&2; echo "gpu_check: could not install this checkout" >&2; exit 2; }
fi
exec timeout --signal=TERM "${GPU_CHECK_TIMEOUT:-480}" \
  "$PYTHON" -m lightning_spec.bench.gpu_check --out "$OUT/gpu_check.json" "$@"
