#!/usr/bin/env bash
# The device checks for a session that is lent one GPU (run from the repository root; $OUT collects
# the logs and JSON). Each step has its own time limit so that one slow step cannot eat the others;
# the whole script is sized for ~6 minutes on an H100. In order of value:
#   1. `pytest -m gpu`: the CUDA kernels' glue against CPU references (attention, varlen, grouped GEMM);
#   2. `longctx bench moe --device cuda`: the MoE layer on one GPU (grouped kernel vs loop vs dense);
#   3. the README's `longctx train` on the GPU, `longctx generate` from it, then the debug MoE model
#      (the grouped kernel under autocast);
#   4. `longctx bench memory --max-seq`: the longest llama3-1b sequence one GPU trains (packed 8K documents).
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LONGCTX_CACHE=/tmp/longctx-cache
longctx() { python3 -m longctx "$@"; }
nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
echo "== pytest -m gpu"
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_attention.py tests/unit/test_varlen.py \
  tests/unit/test_moe_grouped_mm.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu.log"
echo "== bench moe --device cuda"
timeout 90 python3 -m longctx bench moe --device cuda --dim 2048 --experts 64 --top-k 8 --expert-dim 768 \
  --skew-share 0.125 --seq-len 8192,32768 --repeats 5 > "$OUT/moe_gpu.json"; echo "rc $?"
python3 -c "import json; [print(r['routing'], r['tokens'], round(r['moe_kernel_s']*1e3, 2), round(r['moe_loop_s']*1e3, 2),
  round(r['dense_s']*1e3, 2)) for r in json.load(open('$OUT/moe_gpu.json'))['timing']]" || true
echo "== longctx train (the README's default, on the GPU)"
timeout 150 python3 -m longctx train --train.run_dir /tmp/run_default > "$OUT/train_default.log" 2>&1; echo "rc $?"
cp /tmp/run_default/metrics.jsonl "$OUT/train_default_metrics.jsonl" || true
tail -5 "$OUT/train_default.log"
echo "== longctx generate from it (KV-cache decoding on the GPU)"
timeout 40 python3 -m longctx generate --checkpoint /tmp/run_default/checkpoints --prompt "def main():" \
  --max-new-tokens 64 2>&1 | tail -4
echo "== longctx train debug-moe"
timeout 60 python3 -m longctx train --model.preset debug-moe --train.steps 60 --train.run_dir /tmp/run_moe \
  > "$OUT/train_moe.log" 2>&1; echo "rc $?"
tail -4 "$OUT/train_moe.log"
echo "== bench memory --max-seq (llama3-1b, 8K documents)"
timeout 110 python3 -m longctx bench memory --preset llama3-1b --max-seq --seq-len= --policies none,offload1.0 \
  --doc-len 8192 --max-seq-hi 1048576 --out "$OUT/memory_maxseq.json" 2>&1 | tail -25; echo "rc $?"
