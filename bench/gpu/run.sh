#!/usr/bin/env bash
# The one command on a bare GPU machine (its image's python3 holds torch and transformers), run from the
# repository root with .whl/ carried (bench/gpu/wheels.sh made it). Writes every figure under $OUT (or
# ./gpu-out): one JSON per step, rewritten after each part, and the log.
#
#   bench/gpu/run.sh              # wave 6's list: eight_b; label_free,moe; lora (about 14 minutes, estimated)
#   bench/gpu/run.sh PARTS...     # other parts of bench/gpu_check.py, each step comma-separated
#   DEVICE=cpu SIZE=small WHEELS=DIR bench/gpu/run.sh    # the same steps rehearsed on a CPU
#
# Each step is one gpu_check process whose families are deleted when it ends, so the full-depth 8B
# family (42 GB: a base and two experts) has the disk to itself.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}" DEVICE="${DEVICE:-cuda}" SIZE="${SIZE:-full}" WHEELS="${WHEELS:-.whl}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
  || { echo "installing $WHEELS failed: run bench/gpu/wheels.sh where pip reaches the registry, and carry .whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"; } | tee "$OUT/machine.txt"
df -h / /tmp | tee -a "$OUT/machine.txt"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(eight_b label_free,moe lora)
status=0
for step in "${STEPS[@]}"; do
  models="/tmp/gpu-models-${step//,/-}"
  "$PYTHON" bench/gpu_check.py --device "$DEVICE" --size "$SIZE" --parts "$step" --models "$models" --budget 4 \
    --out "$OUT/gpu-check-${step//,/-}.json" 2>&1 | tee -a "$OUT/log.txt" || status=1
  rm -rf "$models"
done
exit $status
