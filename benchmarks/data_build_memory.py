"""Peak memory and throughput of `longctx data build`, and what the store holds (JSON on stdout).

Runs the build as a subprocess and samples, every 50 ms, the resident memory (VmRSS) summed over
the build's whole process tree (the main process and its scan workers; shared pages counted once
per process, so this over-states the machine's use). With `--baseline-src`, the same build is run
a second time from another checkout's `src` (e.g. the in-memory build before the streaming one)
and the two stores are compared: same document names, tokens, fill rate.

    git worktree add /tmp/old <commit before the streaming build>
    python benchmarks/generated_corpus.py --out /data/gen400 --mb 420
    python benchmarks/data_build_memory.py --input /data/gen400 --max-memory 300MB --seq-len 8192 \\
        --baseline-src /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _children() -> dict[int, int]:
    """pid -> ppid of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_mb(root: int) -> float:
    parents = _children()
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for c, pp in parents.items():
            if pp == p and c not in tree:
                tree.add(c)
                frontier.append(c)
    return sum(_rss_kb(p) for p in tree) / 1024


def run_build(src: str, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "longctx", "data", "build", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, peak_main, samples = 0.0, 0.0, []

    def sample():
        nonlocal peak, peak_main
        while proc.poll() is None:
            m = tree_rss_mb(proc.pid)
            main_mb = _rss_kb(proc.pid) / 1024
            if m > peak:
                samples.append((round(time.perf_counter() - t0, 1), round(m, 1), round(main_mb, 1)))
            peak, peak_main = max(peak, m), max(peak_main, main_mb)
            time.sleep(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out = proc.communicate()[0]
    th.join()
    dt = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"build failed ({proc.returncode}):\n{out}")
    return {"seconds": round(dt, 1), "peak_rss_mb": round(peak, 1), "peak_main_process_mb": round(peak_main, 1),
            "rising_peaks": samples[-5:], "log": out.splitlines()}


def store_summary(root: Path) -> dict:
    m = json.loads((root / "manifest.json").read_text())
    names = []
    for part in m["parts"]:
        with open(root / part["dir"] / "docs.jsonl") as f:
            names.extend(json.loads(line)["name"] for line in f)
    return {"documents": m["totals"]["documents"], "tokens": m["totals"]["tokens"],
            "train_fill": m["packing"]["train"]["fill_rate"], "train_samples": m["totals"]["train_samples"],
            "duplicates_removed": m["totals"]["duplicates_removed"],
            "raw_mb": m["parts"][0]["counts"]["raw_bytes"] / 1e6, "names": names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--max-memory", default="300MB")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--baseline-src", default="", help="another checkout's src: its build is the reference")
    ap.add_argument("--keep", default="", help="keep the stores under this directory")
    args = ap.parse_args()
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="lc-build-mem-"))
    common = ["--input", args.input, "--seq-len", str(args.seq_len), "--workers", str(args.workers), "--no-progress",
              "--eval-fraction", "0"]
    result = {"bench": "data_build_memory", "machine": f"{platform.node()} ({os.cpu_count()} cores)",
              "date": time.strftime("%Y-%m-%d"), "input": args.input, "seq_len": args.seq_len,
              "max_memory": args.max_memory, "workers": args.workers}
    runs = {"streaming": (args.src, ["--max-memory", args.max_memory])}
    if args.baseline_src:
        runs["baseline"] = (args.baseline_src, [])
    summaries = {}
    for label, (src, extra) in runs.items():
        out = tmp / label
        shutil.rmtree(out, ignore_errors=True)
        r = run_build(src, [*common, "--out", str(out), *extra])
        s = store_summary(out)
        summaries[label] = s
        result[label] = {**r, **{k: v for k, v in s.items() if k != "names"},
                         "mb_per_s": round(s["raw_mb"] / r["seconds"], 2)}
        print(json.dumps({label: result[label]}), file=sys.stderr, flush=True)
    if "baseline" in summaries:
        a, b = summaries["streaming"], summaries["baseline"]
        result["same_documents"] = a["names"] == b["names"]
        result["same_tokens"] = a["tokens"] == b["tokens"]
        result["fill_difference"] = round(a["train_fill"] - b["train_fill"], 5)
        result["throughput_ratio"] = round(result["streaming"]["mb_per_s"] / result["baseline"]["mb_per_s"], 3)
    bound = float(args.max_memory.upper().rstrip("B").rstrip("M")) if args.max_memory.upper().endswith("MB") else None
    if bound:
        result["peak_over_bound"] = round(result["streaming"]["peak_rss_mb"] / bound, 3)  # both MiB
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
