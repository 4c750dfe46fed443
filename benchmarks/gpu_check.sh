#!/usr/bin/env bash
# The GPU figures, in one command on one GPU machine (an H200 here), within ~9 minutes: see
# benchmarks/gpu_check.py for the steps. Writes $OUT/gpu_check.json (every figure, every step's
# status) and $OUT/gpu_check.log; exits non-zero when a step failed or an import is missing.
# The device image has its own torch and no qwen-tts: run benchmarks/gpu_wheels.sh here first (it
# fills .whl/ with what the image lacks), then call the device tool with carry [".whl"] and
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo '{"ok": false, "error": "wheel install failed"}' > "$OUT/gpu_check.json"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 benchmarks/gpu_check.py
