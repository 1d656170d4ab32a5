#!/usr/bin/env bash
# Document-sparse attention figures of docs/results/attention_docs_2026-11-23.json: one JSON object per line,
# each with "figure" naming the acceptance figure it serves (8 heads, 8 kv heads, head_dim 64, fp32,
# 1,024-token documents, 1 thread per rank and for the single-process references).
# Usage: benchmarks/attention_docs.sh > docs/results/attention_docs_2026-11-23.json   (about 25 min on a 2-core CPU)
# STORE: a store built by `longctx data build --input stdlib --strategy concat --seq-len 32768 --out $STORE`
# (built here if missing). Measure on an otherwise idle machine: every line records the load average.
set -euo pipefail
STORE=${STORE:-/tmp/stdlib_concat_32k}
run() {
  local figure=$1; shift
  longctx bench attention "$@" | python -c "import json,sys; print(json.dumps({'figure': sys.argv[1], **json.load(sys.stdin)}))" "$figure"
}
# a + c: one process at 16K (packed vs per-document sum vs plain causal) and 4 ranks, head 2 x ctx 2
run a,c --docs 1024 --seq-len 16384 --world 4 --head 2 --ctx 2 --repeats 3
# c, without oversubscription: 2 ranks on 2 cores (ctx 2, then head 2)
run c-2ranks-ctx --docs 1024 --seq-len 16384 --world 2 --head 1 --ctx 2 --repeats 3 --no-causal-reference --no-storage-tracker
run c-2ranks-head --docs 1024 --seq-len 16384 --world 2 --head 2 --ctx 1 --repeats 3 --no-causal-reference --no-storage-tracker
# d: no documents, 4 ranks head 2 x ctx 2 at 16K (the benchmark as before --docs); noisy (+-0.04):
# the recorded file has it three times (once with other test runs going, see machine.pytest_processes)
run d --world 4 --head 2 --ctx 2 --seq-len 16384 --repeats 3
# b: packed memory growth against the length (8K, 32K, 64K; 16K is line a)
run b --docs 1024 --seq-len 8192 --world 4 --head 2 --ctx 2 --repeats 3
run b --docs 1024 --seq-len 32768 --world 4 --head 2 --ctx 2 --repeats 2
run b --docs 1024 --seq-len 65536 --world 4 --head 2 --ctx 2 --repeats 2 --no-causal-reference
# e: a real store's first sample at 32K, ctx 4: docs balance, then zigzag (imbalance over the whole train split too)
if [ ! -f "$STORE/manifest.json" ]; then
  longctx data build --input stdlib --strategy concat --seq-len 32768 --out "$STORE" >&2
fi
run e --docs "store:$STORE" --world 4 --head 1 --ctx 4 --seq-balance docs --imbalance-samples 940 --repeats 3 --no-causal-reference
run e --docs "store:$STORE" --world 4 --head 1 --ctx 4 --seq-balance zigzag --repeats 3 --no-causal-reference
# d, baseline: the same run on the code before document-sparse attention (commit dba21b4, flag --seq),
# for a same-machine, same-day comparison. BASELINE=1 to include it.
if [ "${BASELINE:-0}" = 1 ]; then
  old=$(mktemp -d)
  git archive dba21b4 src | tar -x -C "$old"
  PYTHONPATH="$old/src" python -m longctx bench attention --world 4 --head 2 --ctx 2 --seq 16384 --repeats 3 |
    python -c "import json,sys; print(json.dumps({'figure': 'd-baseline-dba21b4', **json.load(sys.stdin)}))"
  rm -rf "$old"
fi
