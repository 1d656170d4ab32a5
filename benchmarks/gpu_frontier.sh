#!/usr/bin/env bash
# Issue 49, first part: model states in host memory on the GPU we are lent (run from the repository
# root; $OUT collects the logs). Sized for about 6 minutes; each step has its own time limit.
#   1. memory.model_states = host against device on the GPU: the debug model, 30 steps, the per-step
#      losses compared (the host path has not run on a GPU before this script);
#   2. the longest sequence llama3-1b (full depth) trains one step at, under host states, checkpoint
#      offload (recompute full + offload_fraction 1.0) and chunked blocks / attention / loss: each
#      length in a fresh process, stopping at the first that fails; its device peak (the metrics
#      line), host peak (max RSS) and tokens/s.
# On CPU it checks its own glue: PRESET=debug LENGTHS="1024 2048" DEVICE=cpu bash benchmarks/gpu_frontier.sh
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LONGCTX_CACHE=${LONGCTX_CACHE:-/tmp/longctx-cache}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-llama3-1b}
LENGTHS=${LENGTHS:-"65536 131072 262144 524288"}
CHUNK=${CHUNK:-8192}
COMMON=(--nproc 1 --train.device "$DEVICE" --train.eval_interval 0 --checkpoint.final false
        --metrics.plots false --metrics.progress false --metrics.log_interval 1)
[ "$DEVICE" = cuda ] && { nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; }

echo "== 1. host vs device states, debug model, 30 steps"
for tier in device host; do
  timeout 120 python3 -m longctx train "${COMMON[@]}" --train.steps 30 --memory.model_states "$tier" \
    --train.run_dir "/tmp/frontier_$tier" > "$OUT/frontier_smoke_$tier.log" 2>&1; echo "$tier rc $?"
done
python3 - "$OUT" <<'EOF'
import json, sys
def losses(tier):
    try:
        return [r["loss"] for r in map(json.loads, open(f"/tmp/frontier_{tier}/metrics.jsonl")) if r.get("kind") == "train"]
    except OSError:
        return []
d, h = losses("device"), losses("host")
diff = max((abs(a - b) for a, b in zip(d, h)), default=None)
print(f"steps {len(d)} / {len(h)}, max |loss(host) - loss(device)| = {diff}")
json.dump({"device": d, "host": h, "max_abs_diff": diff}, open(f"{sys.argv[1]}/frontier_smoke.json", "w"))
EOF

echo "== 2. $PRESET, full depth: the longest sequence one step trains at (host states, checkpoint offload, chunks)"
for seq in $LENGTHS; do
  run=/tmp/frontier_$seq
  /usr/bin/time -v timeout 150 python3 -m longctx train "${COMMON[@]}" --model.preset "$PRESET" \
    --train.seq_len "$seq" --train.global_batch 1 --train.steps 2 --train.warmup_steps 1 --data.max_docs 3000 \
    --memory.model_states host --memory.recompute full --memory.offload_fraction 1.0 \
    --memory.block_chunk "$CHUNK" --memory.attention_chunk "$CHUNK" --memory.loss_chunk "$CHUNK" \
    --train.run_dir "$run" > "$OUT/frontier_$seq.log" 2>&1
  rc=$?
  rss=$(grep "Maximum resident set size" "$OUT/frontier_$seq.log" | awk '{print $NF}')
  line=$(grep "^step     2 |" "$OUT/frontier_$seq.log" | tail -1)
  echo "$seq tokens: rc $rc, host peak $((${rss:-0} / 1024)) MiB, $line"
  [ "$rc" = 0 ] || { tail -5 "$OUT/frontier_$seq.log"; break; }
done
