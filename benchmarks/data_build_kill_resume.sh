# SIGKILL a data build mid-scan, run it again, and compare its part with an uninterrupted build's.
#   bash benchmarks/data_build_kill_resume.sh [INPUT] [SECONDS_BEFORE_KILL]
set -e
INPUT=${1:-/work/gc100}
AFTER=${2:-6}
OPTS="--input $INPUT --seq-len 8192 --no-progress --eval-fraction 0.02 --max-memory 300MB"
rm -rf /tmp/kr_whole /tmp/kr_killed
python -m longctx data build $OPTS --out /tmp/kr_whole > /tmp/kr_whole.log 2>&1
setsid python -m longctx data build $OPTS --out /tmp/kr_killed > /tmp/kr_killed1.log 2>&1 &
pid=$!
sleep "$AFTER"
echo "shards done before the kill: $(ls /tmp/kr_killed/.build/shards | wc -l) (half-written: $(ls -a /tmp/kr_killed/.build/shards | grep -c '^\.tmp' || true))"
kill -KILL -- -$pid || true
sleep 1
python -m longctx data build $OPTS --out /tmp/kr_killed > /tmp/kr_killed2.log 2>&1
grep resuming /tmp/kr_killed2.log || true
for f in /tmp/kr_whole/part-00000/*; do
  cmp "$f" "/tmp/kr_killed/part-00000/$(basename "$f")" && echo "same $(basename "$f")"
done
