"""ZeRO++'s int8 kernels (parallel/fsdp/quantized.py), eager against compiled, on one device (issue 50:
"qwZ's quantize/dequantize kernels (torch ops, compiled) at least 20 GB/s on the card").

    python benchmarks/zero_pp_kernels.py --device cuda --elements 268435456 --out docs/results/...json

The kernels FSDP's hooks run: quantising a shard (quantize_blocks), and dequantising a gather of 8
ranks' rows straight into the output buffer in the gather dtype (qwz's `dequantize_into`). GB/s
counts the --dtype values quantised, or written, per second (what a gather of that many weights
costs either way); the int8 values, scales and dequantised values of both kernels are compared bit
for bit. Each figure is the best of --repeats timed calls after a warm-up call (the compile's, for
the compiled kernels).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date

import torch

from longctx.parallel.fsdp.quantized import _kernel, quantize_blocks


def _best(fn, repeats: int, device: torch.device) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--elements", type=int, default=1 << 26, help="values per call (default 64M)")
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the gathered values' dtype")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    x = torch.randn(args.elements, device=device).to(dtype)
    nbytes = x.numel() * x.element_size()
    ranks = 8  # the gathered rows: --elements / 8 per rank's shard
    if args.elements % (ranks * args.block):
        raise SystemExit(f"--elements must be a multiple of {ranks} x --block = {ranks * args.block}")
    rows, reference = {}, None
    for name, compiled in (("eager", False), ("compiled", True)):
        q, scale = quantize_blocks(x, args.block, compiled)
        out = torch.empty(ranks, x.numel() // ranks, device=device, dtype=dtype)
        into = _kernel("dequantize_into", compiled)
        into(out, q.view(ranks, -1, args.block), scale.view(ranks, -1))
        if reference is None:
            reference = (q, scale, out.clone())
        identical = all(torch.equal(a, b) for a, b in zip((q, scale, out), reference))
        quantize_s = _best(lambda c=compiled: quantize_blocks(x, args.block, c), args.repeats, device)
        dequantize_s = _best(lambda k=into, o=out, q=q, s=scale: k(o, q.view(ranks, -1, args.block), s.view(ranks, -1)),
                             args.repeats, device)
        rows[name] = {"quantize_s": quantize_s, "quantize_gbps": nbytes / quantize_s / 1e9,
                      "dequantize_s": dequantize_s, "dequantize_gbps": nbytes / dequantize_s / 1e9,
                      "identical_to_eager": identical}
        print(f"{name}: quantize {rows[name]['quantize_gbps']:.2f} GB/s, dequantize "
              f"{rows[name]['dequantize_gbps']:.2f} GB/s, identical {identical}", flush=True)
    card = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    doc = {"benchmark": "zero_pp_kernels", "date": date.today().isoformat(), "device": card,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "elements": args.elements,
           "block": args.block, "dtype": args.dtype, "kernels": rows}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
