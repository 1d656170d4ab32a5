#!/usr/bin/env bash
# Issue 34's wall-time figures on one GPU (run from the repository root; $OUT collects logs and JSON):
# the GliDe recipe's three models trained on the GPU (configs as on a CPU), then `bench decode
# --device cuda --cape both` at 1K and 8K on held-out prompts (the torch package's sources), the
# GliDe draft and the plain draft. On a CPU, verifying 5 tokens against 8K keys and CaPE's extra
# tree nodes are compute (docs/benchmarks.md); on a GPU they ride in one memory-bound pass, which
# is what the CaPE and 8K items ask about. Sized for ~6 minutes on an H100.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LONGCTX_CACHE=/tmp/longctx-cache
W=/tmp/glide_gpu; mkdir -p "$W"
echo "== train the recipe's target, GliDe draft and plain draft on the GPU"
timeout 150 python3 -m longctx train --config configs/glide-target.toml --nproc 1 --train.run_dir $W/target \
  --metrics.progress false > "$OUT/glide_target.log" 2>&1; echo "target rc $?"; tail -2 "$OUT/glide_target.log"
timeout 120 python3 -m longctx train --config configs/glide.toml --nproc 1 --draft.target $W/target/checkpoints \
  --train.run_dir $W/glide --metrics.progress false > "$OUT/glide_draft.log" 2>&1; echo "glide rc $?"
timeout 60 python3 -m longctx train --config configs/glide-plain-draft.toml --nproc 1 --train.run_dir $W/plain \
  --metrics.progress false > "$OUT/glide_plain.log" 2>&1; echo "plain rc $?"
DATA="$(python3 -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torch").origin))')/**/*.py"
for draft in glide plain; do
  echo "== bench decode --device cuda, $draft"
  extra=(); [ $draft = glide ] && extra=(--draft-window 512 --cape both)
  timeout 90 python3 -m longctx bench decode --device cuda --target $W/target/checkpoints --draft $W/$draft/checkpoints \
    --data "$DATA" --lengths 1024,8192 --samples 4 --repeats 2 --max-new-tokens 128 "${extra[@]}" \
    > "$OUT/decode_gpu_$draft.json" 2> "$OUT/decode_gpu_$draft.log"; echo "rc $?"; tail -4 "$OUT/decode_gpu_$draft.log"
done
