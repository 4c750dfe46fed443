#!/usr/bin/env bash
# The GPU figures of issue 11, in one command on one GPU machine (an H200 here), in at most ~8 min.
# Writes every figure to $OUT (the device tool's result folder; runs/gpu_check elsewhere):
#   1. a real NCCL process group through the strategy's setup: `fit` of the tiny model on the GPU
#      with bf16-mixed, the samples callback and a sharded checkpoint (every collective of ours runs
#      under NCCL, which refuses CPU tensors);
#   2. the released 1.7B, one rank of 4 FULL_SHARD (fake process group), capped at 16 GiB: per-rank
#      memory without and with the samples callback, and with cpu_offload; step time, tokens/s, MFU;
#   3. the released 0.6B on one 24 GiB share.
# The device image has no qwen-tts and a transformers too new for it: run benchmarks/gpu_wheels.sh
# here first (it fills .whl/), then call the device tool with carry [".whl"] and the command
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" | tee "$OUT/gpu_check.txt"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
report="$OUT/gpu_check.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; $PY -c "import torch; print('torch', torch.__version__)"; } | tee "$report"

step() {  # step NAME TIMEOUT COMMAND...: run, keep its output, never stop the others
    local name=$1 limit=$2; shift 2
    echo "== $name" | tee -a "$report"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 12 "$OUT/$name.log" | tee -a "$report"
    echo "   exit $rc" | tee -a "$report"
}

work=runs/gpu_check_work
step nccl_fit 120 $PY -m tts_lightning fit --config configs/tiny-cpu.yaml --data.pretrained tiny \
    --trainer.accelerator gpu --trainer.devices 1 --trainer.precision bf16-mixed --trainer.max_steps 4 \
    --trainer.val_check_interval 2 --trainer.default_root_dir $work/tiny --trainer.logger.init_args.save_dir $work/tiny \
    --data.cache_dir $work/cache "--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback" \
    --trainer.callbacks.max_new_tokens 24 --trainer.callbacks.similarity false
step build_1.7b 150 $PY benchmarks/released_dir.py 1.7b runs/bench/released-1.7b
step real_1.7b_16gb 120 $PY benchmarks/real_size.py --device cuda --gpu-memory 16 --frames 2000 --steps 4 \
    --out "$OUT/real_1.7b_16gb.json"
step real_1.7b_16gb_samples 120 $PY benchmarks/real_size.py --device cuda --gpu-memory 16 --frames 2000 --steps 2 \
    --samples --out "$OUT/real_1.7b_16gb_samples.json"
step real_1.7b_16gb_offload 150 $PY benchmarks/real_size.py --device cuda --gpu-memory 16 --frames 2000 --steps 2 \
    --cpu-offload --out "$OUT/real_1.7b_16gb_offload.json"
step real_0.6b_24gb 120 $PY benchmarks/real_size.py --size 0.6b --world 1 --device cuda --gpu-memory 24 \
    --frames 2000 --steps 4 --out "$OUT/real_0.6b_24gb.json"
echo "figures: $report" 
