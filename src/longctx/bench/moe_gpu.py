"""`longctx bench moe --device cuda`: the MoE layer on one GPU, no emulation.

Wall time of forward + backward (synchronised, the least over --repeats after a warm-up) of three
layers in bf16 with the same active parameters:
- `moe_kernel_s`: models/moe.py's MoEFeedForward with its experts through torch._grouped_mm (one
  kernel for every expert, no host read of the counts) where the kernel runs: `config.grouped` says
  which path it took (the loop, where the build lacks the kernel or a width is not a multiple of 16
  bytes: then `moe_kernel_s` times the loop too, and `kernel_over_loop` is null);
- `moe_loop_s`: the same layer with ops/grouped.py's loop over experts (one GEMM per expert after a
  host read of the counts: what a build without the kernel runs);
- `dense_s`: the dense SwiGLU of top-k x expert_dim;
- with --compile, `moe_compiled_s`: the MoE layer under torch.compile(fullgraph=True), the routing,
  the sort-based permutation and the weighted combine fused around the grouped kernel.
Under uniform and skewed routing (as the CPU benchmark routes), with the peak allocated memory of
the MoE step. Several experts per rank and one GPU: this is the layer, not expert parallelism
(which needs a node: `--cluster ... --no-emulation` on one).
"""

from __future__ import annotations

import functools
import platform
import statistics
import time
from datetime import date

import torch

from .. import strict_json
from ..job.devices import code_record
from ..ops.grouped import grouped_path, use_loop
from ..progress import phase
from ..train.profile_step import profile_call
from . import moe_common as common


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall(layer, x, grad, repeats: int, loop: bool = False) -> dict:
    def once() -> float:
        _sync(x.device)
        t0 = time.perf_counter()
        if loop:
            with use_loop():
                common.fwd_bwd(layer, x, grad)
        else:
            common.fwd_bwd(layer, x, grad)
        _sync(x.device)
        return time.perf_counter() - t0

    once()  # warm-up
    runs = [once() for _ in range(repeats)]
    return {"min": min(runs), "median": statistics.median(runs)}


def _out_of_memory_row(routing: str, seq: int, e: torch.OutOfMemoryError, device: torch.device) -> dict:
    """The row of a length whose layers did not fit on the card: the rows before it were lost with the
    traceback (`--seq-len 8192,32768,131072` printed nothing)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    said = str(e).splitlines()[0][:200] if str(e) else ""
    common.say(f"{routing}, {seq:,} tokens: GPU out of memory ({said})")
    return {"routing": routing, "tokens": seq, "fits": False, "error": f"GPU out of memory: {said}"}


def _timing_row(routing: str, seq: int, bias, load: float, peak, kernel_ran: bool, walls: dict) -> dict:
    """One routing x length's row of figures from its walls ({name: _wall's {"min", "median"}}; compiled None
    when not asked)."""
    kernel, loop, dense, fused = walls["kernel"], walls["loop"], walls["dense"], walls["compiled"]
    row = {"routing": routing, "tokens": seq, "expert0_bias": bias, "load_max_over_mean": load,
           "moe_kernel_s": kernel["min"], "moe_loop_s": loop["min"], "dense_s": dense["min"],
           "kernel_over_dense": common.ratio(kernel["min"], dense["min"]),
           "kernel_over_loop": common.ratio(kernel["min"], loop["min"]) if kernel_ran else None,
           "moe_tokens_per_s": seq / kernel["min"], "moe_peak_allocated_bytes": peak,
           "medians": {"kernel": kernel["median"], "loop": loop["median"], "dense": dense["median"]}}
    if fused is not None:
        row.update(moe_compiled_s=fused["min"], compiled_over_dense=common.ratio(fused["min"], dense["min"]))
        row["medians"]["compiled"] = fused["median"]
    return row


def main(args, device: torch.device | None = None) -> int:
    """(`device`: cuda unless given; the CPU runs it only to check the code.)"""
    device = device or torch.device("cuda")
    cuda = device.type == "cuda"
    moe, dense, cfg = common.build_layers(args)
    moe.to(device, torch.bfloat16)
    dense.to(device, torch.bfloat16)
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    # (the same module compiled: its first call per length compiles, inside _wall's warm-up)
    compiled = torch.compile(moe, fullgraph=True) if getattr(args, "compile", False) else None
    # the path the experts' GEMMs take outside use_loop() (the kernel needs bf16 widths of 8's multiples)
    path = {grouped_path(torch.empty(0, w.shape[-1], device=device, dtype=w.dtype), w.transpose(1, 2))
            for w in (moe.experts.w1, moe.experts.w2)}
    kernel_ran = path == {"torch._grouped_mm"}
    rows = []
    for routing in (r for r in args.routing.split(",") if r):
        for seq in (int(s) for s in args.seq_len.split(",") if s):
            try:
                x = torch.randn(1, seq, args.dim, generator=gen, device=device, dtype=torch.bfloat16,
                                requires_grad=True)
                grad = torch.randn_like(x)
                moe.router.expert_bias.zero_()
                bias = common.skew(moe, x, args.skew_share) if routing == "skewed" else 0.0
                share = common.choice_share(moe, x)
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                with phase(f"bench moe on {device.type}: {routing} routing, {seq:,} tokens", done_line=False):
                    kernel = _wall(moe, x, grad, args.repeats)
                    peak = torch.cuda.max_memory_allocated(device) if cuda else None
                    loop = _wall(moe, x, grad, args.repeats, loop=True)
                    dense_t = _wall(dense, x, grad, args.repeats)
                    fused = _wall(compiled, x, grad, args.repeats) if compiled is not None else None
            except torch.OutOfMemoryError as e:  # (a length past the card: its row says so, the others keep theirs)
                x = grad = None  # (freed before the cache is emptied: not the next length's to fit beside)
                rows.append(_out_of_memory_row(routing, seq, e, device))
                continue
            row = _timing_row(routing, seq, bias, float(share.max() * args.experts), peak, kernel_ran,
                              {"kernel": kernel, "loop": loop, "dense": dense_t, "compiled": fused})
            if getattr(args, "profile", False):  # where the MoE layer's time goes, beside the dense one's
                row["profile"] = {name: profile_call(functools.partial(common.fwd_bwd, m, x, grad), cuda)
                                  for name, m in (("moe", moe), ("dense", dense))}
            common.say(f"{routing}, {seq:,} tokens: kernel {kernel['min'] * 1e3:.2f} ms, loop "
                      f"{loop['min'] * 1e3:.2f} ms, dense {dense_t['min'] * 1e3:.2f} ms")
            rows.append(row)
    print(strict_json.dumps({
        "bench": "moe", "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "config": {"dim": args.dim, "experts": args.experts, "top_k": args.top_k, "expert_dim": cfg.resolved_expert_dim,
                   "dense_ffn_dim": cfg.ffn_dim, "dtype": "bf16", "repeats": args.repeats,
                   "grouped": "torch._grouped_mm" if kernel_ran else "loop (the kernel does not run here)"
                   if "torch._grouped_mm" not in path else "kernel for some GEMMs, loop for the others",
                   "timing": "least wall time of a synchronised forward+backward over the repeats"},
        "active_params": common.measured_active_params(moe, dense, args.top_k), "timing": rows,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "code": code_record()},
    }, indent=2))
    return 0
