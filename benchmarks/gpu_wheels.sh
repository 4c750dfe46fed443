#!/usr/bin/env bash
# Wheels benchmarks/gpu_check.sh needs on the device image (Python 3.12, its own torch): what the
# project imports beyond that image, at the versions qwen-tts pins. Run here, in the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    qwen-tts==0.1.1 transformers==4.57.3 tokenizers==0.22.1 huggingface-hub==0.36.0 accelerate==1.12.0 \
    jsonargparse docstring-parser typeshed-client soundfile sox librosa audioread soxr lazy-loader pooch \
    standard-aifc standard-sunau
du -sh .whl
