#!/usr/bin/env bash
# Fills .whl/ with the wheels benchmarks/gpu_check.sh needs on the device image (benchmarks/gpu_wheels.py
# says which and why). Run here, in the repo root, before the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 benchmarks/gpu_wheels.py
