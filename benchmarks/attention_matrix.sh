#!/usr/bin/env bash
# The attention benchmark matrix of docs/benchmarks.md: one JSON object per line on stdout.
# Usage: benchmarks/attention_matrix.sh > attention.jsonl   (about 25 min on a 2-core CPU)
set -euo pipefail
run() { longctx bench attention "$@" --repeats 2 | python -c "import json,sys; print(json.dumps(json.load(sys.stdin)))"; }
run --world 2 --head 1 --ctx 2 --seq-len 8192
run --world 2 --head 2 --ctx 1 --seq-len 8192
run --world 4 --head 1 --ctx 4 --seq-len 8192
run --world 4 --head 2 --ctx 2 --seq-len 8192
run --world 4 --head 4 --ctx 1 --seq-len 8192
run --world 4 --head 1 --ctx 4 --window 2 --seq-len 8192
run --world 2 --head 1 --ctx 2 --seq-len 16384
run --world 4 --head 1 --ctx 4 --seq-len 16384
run --world 4 --head 2 --ctx 2 --seq-len 16384
run --world 8 --head 1 --ctx 8 --seq-len 16384
run --world 8 --head 2 --ctx 4 --seq-len 16384
run --world 8 --head 1 --ctx 8 --window 2 --seq-len 16384
