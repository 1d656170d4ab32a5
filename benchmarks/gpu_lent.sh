#!/usr/bin/env bash
# What a session that is lent a GPU runs, in two device calls (run from the repository root):
#   run(command="bash benchmarks/gpu_lent.sh", timeout_s=590)                       # part 1, ~560 s
# (prefix LONGCTX_COMMIT=<this checkout's `git rev-parse HEAD`>: the device's copy has no .git, and the JSON
# records the commit that measured it from there)
#   run(command="PART=2 TOTAL_S=<budget_left_s - 60> bash benchmarks/gpu_lent.sh", timeout_s=<that + 20>)
# Part 1 runs benchmarks/gpu_frontier.sh (issue 49) with the probes that matter most (PROBES, default cuda_process,
# smoke,blocks: the `host` tier's first whole steps on a card and the 8B blocks' depth check) and
# BUDGET_S=${FRONTIER_S:-340}, then benchmarks/gpu_speed.sh (issue 52; SPEED_STEPS default 1,6) with
# BUDGET_S = what is left of ${TOTAL_S:-560} s counted from this script's start, so a slow frontier eats the speed steps' time
# instead of overrunning the call (each script skips what no longer fits and still prints its summary).
# Part 2 (PART=2) runs the frontier's llama3-1b probe (PROBES default longest; LONGEST default 524288, the
# length the issue asks: 256K trained on an H200 on 2026-12-04; FRONTIER_S default 210 s), then the speed
# steps part 1 rarely reaches (SPEED_STEPS default 2,3,4,8: the MoE layer, the debug model's decode, decode
# against transformers, one compiled copy for two RoPE frequencies) with the rest of TOTAL_S; its frontier JSON is tagged _part2. The frontier's other
# probes (overlap: 75% hidden on 2026-12-04; blocks_host) run when PROBES names them. The JSON is written to
# docs/results/ on the device machine, but only $OUT comes back from it, and at most 8 files of it: the
# new docs/results files are copied to $OUT/results/, and then all of $OUT (the scripts' logs and JSON,
# a dozen files and more) is packed into the one file $OUT/gpu_lent.tgz; unpack it here and copy its
# results/ into docs/results/ for the commit.
# Glue check on CPU (the frontier's own glue check; gpu_speed.sh with DEVICE=cpu only prints its steps):
#   DEVICE=cpu SMOKE_STEPS=3 SEQ_8B=2048 SEQ_OVERLAP=1024 LONGEST="2048 1024" PRESET_8B=debug \
#     PRESET_1B=debug FRONTIER_S=200 TOTAL_S=230 DRY_STEP_S=40 bash benchmarks/gpu_lent.sh
#   (and the same with PART=2)
set -u
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT" docs/results
PART=${PART:-1}; TOTAL_S=${TOTAL_S:-560}
MARK=$(mktemp); trap 'rm -f "$MARK"' EXIT  # docs/results files newer than this are this call's
if [ "$PART" = 2 ]; then
  export PROBES=${PROBES:-longest} LONGEST=${LONGEST:-524288} TAG=${TAG:-_part2}
  FRONTIER_S=${FRONTIER_S:-210}; [ "$FRONTIER_S" -gt "$TOTAL_S" ] && FRONTIER_S=$TOTAL_S
  echo "=== gpu_lent part 2: gpu_frontier.sh ($PROBES) with ${FRONTIER_S} s, then gpu_speed.sh (${SPEED_STEPS:=2,3,4,8})"
  BUDGET_S=$FRONTIER_S bash benchmarks/gpu_frontier.sh
  LEFT=$((TOTAL_S - SECONDS)); [ "$LEFT" -lt 0 ] && LEFT=0
  echo "=== gpu_lent: gpu_frontier.sh took ${SECONDS} s; gpu_speed.sh ($SPEED_STEPS) gets ${LEFT} s"
  SPEED_STEPS=$SPEED_STEPS BUDGET_S=$LEFT bash benchmarks/gpu_speed.sh
else
  # (340 s: the 8B blocks at 1M on an H200 take ~2 x their 512K time, 154 s on 2026-12-04; what the
  # frontier leaves unused goes to the speed steps; the smoke runs `device`, the reference, and `host`, the tier
  # not yet through a step on a card: host_optimizer's losses followed device's there on 2026-12-04)
  FRONTIER_S=${FRONTIER_S:-340}
  export PROBES=${PROBES:-cuda_process,smoke,blocks} SMOKE_TIERS=${SMOKE_TIERS:-device,host}
  echo "=== gpu_lent part 1: gpu_frontier.sh ($PROBES) with ${FRONTIER_S} s, then gpu_speed.sh with the rest of ${TOTAL_S} s"
  BUDGET_S=$FRONTIER_S bash benchmarks/gpu_frontier.sh
  LEFT=$((TOTAL_S - SECONDS)); [ "$LEFT" -lt 0 ] && LEFT=0
  # (the speed steps: 1, training against transformers, and 6, an MoE model under the host tier; 2-4 are the second
  # call's; 5 and 7, the ZeRO++ kernels and train.deterministic, held on 2026-12-04: SPEED_STEPS names them again)
  echo "=== gpu_lent: gpu_frontier.sh took ${SECONDS} s; gpu_speed.sh (${SPEED_STEPS:=1,6}) gets ${LEFT} s"
  SPEED_STEPS=$SPEED_STEPS BUDGET_S=$LEFT bash benchmarks/gpu_speed.sh
fi
mkdir -p "$OUT/results"
echo "=== gpu_lent: done in ${SECONDS} s of ${TOTAL_S}; for the commit, copied to \$OUT/results/:"
find docs/results -maxdepth 1 -name '*.json' -newer "$MARK" -print -exec cp {} "$OUT/results/" \;
PACK=$(mktemp -d)/gpu_lent.tgz  # (8 files at most come back from $OUT: one archive of them all)
tar -C "$OUT" -czf "$PACK" . && find "$OUT" -mindepth 1 -delete && mv "$PACK" "$OUT/" && ls -l "$OUT"
