"""`longctx bench memory --max-seq`: the longest sequence that trains, each length probed in a
fresh process (`longctx bench memory --probe POLICY:SEQ`, bench/memory.py `_probe_step`), so that
neither the GPU's nor the host's memory carries over from one probe to the next.

A probe the host refuses memory to is that probe's answer, "does not fit (host memory)", never a
crash of the search nor a misreported length: the probe's own MemoryError or allocator error (its
JSON says so), or its death by SIGKILL, which is what the kernel's out-of-memory killer sends.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from ..progress import speaker

say = speaker("bench memory ", clock=True)


def parse_bytes(text: str) -> int:
    """'6GiB', '512MiB', '2.5GB', '1000000' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1, "": 1}
    t = text.strip().lower()
    num = t.rstrip("kmgtib")
    try:
        value = float(num) * units[t[len(num):]]
    except (ValueError, KeyError):
        value = math.nan
    if not math.isfinite(value):  # (inf: no step exceeds it, and int() raised an OverflowError traceback)
        raise ValueError(f"cannot read '{text}' as a size; write e.g. 6GiB, 512MiB or 2GB")
    return int(value)


HOST_OOM = "does not fit (host memory)"


def is_host_oom(e: BaseException) -> bool:
    """Whether an exception is the host refusing memory: MemoryError, or torch's CPU (or pinned)
    allocator failing, which raises a RuntimeError."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or ("can't allocate memory" in text or "defaultcpuallocator" in text
                                          or "cudahostalloc" in text or "pinned memory" in text and "out of" in text)


def check_search(args, on_gpu: bool, lo: int = 4096) -> None:
    """A ValueError that says what to pass where the search could not run: a step below one token
    (the CPU search would probe 0 tokens forever), a budget of no bytes (nothing fits: 0 read as
    a measured answer), or a GPU ceiling under the first length probed
    (nothing would be probed, and 0 read as "nothing fits")."""
    if not on_gpu and args.max_seq_step < 1:
        raise ValueError(f"--max-seq-step {args.max_seq_step}: the search resolution must be at least 1 token "
                         f"(e.g. --max-seq-step 4096)")
    if not on_gpu and parse_bytes(args.budget) <= 0:
        raise ValueError(f"--budget {args.budget}: a peak-RSS budget must be positive (e.g. --budget 6GiB)")
    if on_gpu and args.max_seq_hi < lo:
        raise ValueError(f"--max-seq-hi {args.max_seq_hi} is below the shortest length probed ({lo:,} tokens); "
                         f"give --max-seq-hi {lo} or more")


def _probe_command(args, name: str, seq: int, device: str) -> list[str]:
    return [sys.executable, "-m", "longctx", "bench", "memory", "--probe", f"{name}:{seq}", "--device", device,
            "--preset", args.preset, "--layers", str(args.layers if device == "cpu" else 0),
            "--micro-batch", str(args.micro_batch),
            "--skip-last", str(args.skip_last), "--docs", str(args.docs), "--doc-len", str(args.doc_len),
            "--loss-chunk", str(args.loss_chunk), "--block-chunk", str(args.block_chunk),
            "--attention-chunk", str(args.attention_chunk),
            *(["--attention-offload"] if args.attention_offload else [])]


def _run_probe(args, name: str, seq: int, device: str, env=None) -> dict:
    """`_probe_step` in a fresh process: its JSON, or {"fits": false, "error": ...} when it failed or
    was killed. The host refusing memory is that probe's "does not fit (host memory)", whether the
    probe saw it (MemoryError, the CPU allocator's error: its own JSON says so) or was killed for it:
    SIGKILL (-9, or 137 from a shell) is what the kernel's OOM killer sends."""
    run = subprocess.run(_probe_command(args, name, seq, device), capture_output=True, text=True, env=env)
    if run.returncode in (-9, 137):
        return {"seq_len": seq, "fits": False, "host_memory": True,
                "error": f"{HOST_OOM}: killed by SIGKILL (the host's out-of-memory killer)"}
    if run.returncode < 0:
        return {"seq_len": seq, "fits": False, "failed": True, "error": f"killed by signal {-run.returncode}"}
    if run.returncode != 0:  # the host's memory (an answer: does not fit), or a failure (no answer)
        last = run.stderr.strip().splitlines()[-1:]
        if last and ("MemoryError" in last[0] or "can't allocate memory" in last[0]):
            return {"seq_len": seq, "fits": False, "host_memory": True, "error": f"{HOST_OOM}: {last[0][:200]}"}
        # the GPU's memory, where it surfaced outside torch's OutOfMemoryError (a CUDA error, cuBLAS's workspace)
        if last and any(said in last[0].lower() for said in ("out of memory", "alloc_failed")):
            return {"seq_len": seq, "fits": False, "error": f"GPU out of memory: {last[0][:200]}"}
        return {"seq_len": seq, "fits": False, "failed": True, "error": last[0] if last else
                f"exit code {run.returncode}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


class _ProbeFailed(Exception):
    """A probe that failed for another reason than memory: its length is no answer to the search."""


def _answer(probe: dict) -> None:
    """_ProbeFailed where a probe failed for another reason than memory (an error, a signal other than the OOM
    killer's: `_run_probe` marks it "failed"); read as "does not fit", it made the search report the length
    under the failure as the longest that fits."""
    if probe.get("failed"):
        raise _ProbeFailed(f"the probe at {probe['seq_len']:,} tokens failed: {probe['error']}")


def _search_failed(e: _ProbeFailed, probes: list) -> dict:
    """A policy's entry where a probe failed: no longest length (the probes so far kept), the error said."""
    say(f"--max-seq: {e}; no longest length for this policy (its probes are in the JSON)")
    return {"longest_seq_len": None, "error": str(e), "probes": probes}


def longest_sequence_cpu(args, name: str, budget: int) -> dict:
    """CPU: the longest sequence (a multiple of --max-seq-step) whose training step, in a fresh
    process, peaks at most `budget` bytes of RSS; every probe is reported."""
    env = dict(os.environ)
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    probes = []

    def fits(seq: int) -> bool:
        say(f"--max-seq {name}: probing {seq:,} tokens in a fresh process")
        t0 = time.perf_counter()
        probes.append(_run_probe(args, name, seq, "cpu", env))
        _answer(probes[-1])
        if "error" not in probes[-1]:
            probes[-1]["fits"] = probes[-1]["peak_rss_bytes"] <= budget
        rss = probes[-1].get("peak_rss_bytes")
        verdict = ("fits" if probes[-1]["fits"] else HOST_OOM if probes[-1].get("host_memory")
                   else "over the budget" if "error" not in probes[-1] else "failed")
        say(f"--max-seq {name}: {seq:,} tokens -> {verdict} ("
                  + (f"peak RSS {rss / 2**30:.2f} GiB, " if rss is not None else "")
                  + f"{time.perf_counter() - t0:.1f} s)")
        return probes[-1]["fits"]

    step = args.max_seq_step
    lo, hi = step, step
    try:
        while fits(hi):  # grow until a length does not fit
            lo, hi = hi, hi * 2
        best = lo if probes[0]["fits"] else 0
        lo, hi = lo + step, hi - step
        while lo <= hi:
            mid = (lo + hi) // 2 // step * step
            if fits(mid):
                best, lo = mid, mid + step
            else:
                hi = mid - step
    except _ProbeFailed as e:
        return _search_failed(e, probes)
    return {"longest_seq_len": best, "probes": probes}


def longest_sequence(args, name: str, lo: int = 4096) -> dict:
    """GPU: the longest sequence (multiple of 1024, at most --max-seq-hi) for which one
    forward+backward of the full model fits, by binary search; each probe in a fresh process
    (`_run_probe`: a GPU out-of-memory error or a host kill is "does not fit", with its reason)."""
    hi, probes = args.max_seq_hi, []

    def fits(seq: int) -> bool:
        say(f"--max-seq {name}: trying {seq:,} tokens in a fresh process")
        t0 = time.perf_counter()
        probes.append(_run_probe(args, name, seq, "cuda"))
        _answer(probes[-1])
        ok = bool(probes[-1].get("fits"))
        say(f"--max-seq {name}: {seq:,} tokens -> {'fits' if ok else probes[-1].get('error')} "
                  f"({time.perf_counter() - t0:.1f} s)")
        return ok

    best = 0
    try:
        while lo <= hi:
            mid = (lo + hi) // 2 // 1024 * 1024
            if fits(mid):
                best, lo = mid, mid + 1024
            else:
                hi = mid - 1024
    except _ProbeFailed as e:
        return _search_failed(e, probes)
    return {"longest_seq_len": best, "probes": probes}
