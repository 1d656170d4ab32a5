#!/usr/bin/env bash
# Activation memory per policy (measured vs analytic), recompute FLOPs and step-time ratios.
# (32K runs without document masks: one process would build dense 32K x 32K mask biases.)
# Writes docs/memory_<date>_*.json. ~15 min on a 2-core CPU.
set -euo pipefail
d=$(date +%F)
longctx bench memory --preset debug --seq-len 8192 --docs 4 --time-steps 2 --out docs/memory_${d}_debug_8k.json > /dev/null
longctx bench memory --preset debug --seq-len 32768 --docs 1 --time-steps 0 --no-backward --out docs/memory_${d}_debug_32k.json > /dev/null
longctx bench memory --preset small-100m --layers 2 --seq-len 8192 --docs 4 --time-steps 1 --out docs/memory_${d}_100m_8k.json > /dev/null
longctx bench memory --preset small-100m --layers 2 --seq-len 32768 --docs 1 --time-steps 0 --no-backward --out docs/memory_${d}_100m_32k.json > /dev/null
longctx bench memory --preset debug --seq-len 8192 --docs 4 --head 2 --ctx 2 --time-steps 2 --out docs/memory_${d}_debug_8k_head2_ctx2.json > /dev/null
