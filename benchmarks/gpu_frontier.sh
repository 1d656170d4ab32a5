#!/usr/bin/env bash
# Issue 49 on the GPU we are lent: model states in host memory, the longest sequence on one card.
# Run first whenever a device is lent, from the repository root; $OUT collects the logs and JSON,
# and docs/results/gpu_frontier_<card>_<date>.json is written for the commit. Sized for BUDGET_S
# (450 s by default) of probes plus start-up; what each probe measures: benchmarks/gpu_frontier.py.
# benchmarks/gpu_lent.sh's first device call runs it with 340 s, then gpu_speed.sh. The 8B blocks run at the
# issue's length for the card (512K on an H100, 1M on an H200: 512K measured there on 2026-12-04); SEQ_8B overrides.
# Glue check on CPU:
#   DEVICE=cpu SMOKE_STEPS=3 SEQ_8B=2048 SEQ_OVERLAP=1024 LONGEST="2048 1024" PRESET_8B=debug \
#     PRESET_1B=debug bash benchmarks/gpu_frontier.sh
set -u
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LONGCTX_CACHE=${LONGCTX_CACHE:-/tmp/longctx-cache}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
[ "${DEVICE:-cuda}" = cuda ] && nvidia-smi -L
python3 benchmarks/gpu_frontier.py 2>&1 | tee "$OUT/gpu_frontier.log"
# pinned host memory as torch locks it (power-of-two rounding, ops/pinned.py's slabs; ~1 min, JSON only):
# PINNED=1 (measured on an H200 on 2026-12-04: the predictions held, docs/benchmarks.md)
if [ "${PINNED:-0}" = 1 ]; then
  timeout 120 python3 benchmarks/pinned_bytes.py > "$OUT/pinned_bytes.json" 2> "$OUT/pinned_bytes.log" || echo "pinned_bytes.py: rc $?"
fi
