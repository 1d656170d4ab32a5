#!/usr/bin/env bash
# Issue 47's code on one GPU (run from the repository root; $OUT collects logs and JSON), ~4 minutes:
#   1. the README's `longctx train`, then `longctx generate` from it: sampled (T = 1, two samples,
#      logprobs), and one prompt's tokens alone vs in a batch of three (per-request seeds), fp32 and bf16;
#   2. debug-moe with a capacity: the interval router metrics (per-layer drops, heatmap) on CUDA;
#   3. `bench moe --device cuda` (the dispatch with the atomic-free backward).
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LONGCTX_CACHE=/tmp/longctx-cache
rm -rf /tmp/run_default /tmp/run_moe  # (a warm machine keeps the last call's runs)
echo "== train (README default)"
timeout 150 python3 -m longctx train --train.run_dir /tmp/run_default --checkpoint.interval 300 --metrics.progress false > "$OUT/train_default.log" 2>&1
echo "rc $?"; tail -2 "$OUT/train_default.log"
printf '%s\n' '{"prompt": "def main():", "seed": 7}' '{"prompt": "import os\nimport sys\n\nclass Config:"}' \
  '{"prompt": "x"}' > /tmp/p3.jsonl
head -1 /tmp/p3.jsonl > /tmp/p1.jsonl
for dtype in fp32 bf16; do
  for n in 1 3; do
    timeout 40 python3 -m longctx generate --checkpoint /tmp/run_default/checkpoints --prompts /tmp/p$n.jsonl \
      --temperature 1 --max-new-tokens 48 --num-samples 2 --logprobs 3 --train.dtype $dtype \
      --output "$OUT/gen_${dtype}_$n.jsonl" 2>> "$OUT/generate.log"; echo "generate $dtype $n rc $?"
  done
  python3 - "$OUT/gen_${dtype}_1.jsonl" "$OUT/gen_${dtype}_3.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:])
print("prompt 0 alone == in a batch of 3:", [x["tokens"] for x in a[:2]] == [x["tokens"] for x in b[:2]],
      "| samples differ:", a[0]["tokens"] != a[1]["tokens"], "| logprobs:", a[0]["logprobs"][:3])
PY
done
echo "== train debug-moe with a capacity"
timeout 70 python3 -m longctx train --model.preset debug-moe --model.moe.capacity_factor 1.0 --train.steps 60 \
  --train.run_dir /tmp/run_moe --metrics.progress false > "$OUT/train_moe.log" 2>&1; echo "rc $?"
tail -3 "$OUT/train_moe.log"; cp /tmp/run_moe/expert_heatmap.png "$OUT/" 2>/dev/null
python3 -c "import json; r=[json.loads(l) for l in open('/tmp/run_moe/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train'][-1]; print({k: t.get(k) for k in ('step','moe_load_mean','moe_layer_load','moe_layer_drop','moe_drop_rate')})"
echo "== bench moe --device cuda"
timeout 90 python3 -m longctx bench moe --device cuda --dim 2048 --experts 64 --top-k 8 --expert-dim 768 \
  --seq-len 8192,32768 --skew-share 0.125 --repeats 5 > "$OUT/moe_gpu.json"; echo "rc $?"
python3 -c "import json; [print(r['routing'], r['tokens'], round(r['moe_kernel_s']*1e3, 2), round(r['dense_s']*1e3, 2)) for r in json.load(open('$OUT/moe_gpu.json'))['timing']]" || true
