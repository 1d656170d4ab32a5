# SIGKILL a data build mid-scan, run it again, and compare its part with an uninterrupted build's (/tmp/kr_whole).
set -e
. /work/main/.venv/bin/activate
cd /work/main
rm -rf /tmp/kr_killed
true
setsid python -m longctx data build --input /work/gc100 --seq-len 8192 --out /tmp/kr_killed --no-progress --eval-fraction 0.02 --max-memory 300MB > /tmp/kr_killed1.log 2>&1 &
pid=$!
sleep 6
echo "shards done before kill: $(ls /tmp/kr_killed/.build/shards | grep -v tmp | wc -l) (tmp: $(ls -a /tmp/kr_killed/.build/shards | grep -c tmp))"
kill -KILL -- -$pid || true
sleep 1
python -m longctx data build --input /work/gc100 --seq-len 8192 --out /tmp/kr_killed --no-progress --eval-fraction 0.02 --max-memory 300MB > /tmp/kr_killed2.log 2>&1
grep resuming /tmp/kr_killed2.log || true
for f in /tmp/kr_whole/part-00000/*; do cmp "$f" /tmp/kr_killed/part-00000/$(basename $f) && echo "same $(basename $f)"; done
