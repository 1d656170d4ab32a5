"""train.compile: tokens/s with and without it, and what the elementwise part costs in each.

1. Throughput: `longctx train` on small-100m at --seq tokens (fp32, one sequence per step), eager
   and compiled, in one process and under head 2 x ctx 2; tokens/s is the median of the steps
   after the first two (compilation happens in step 1). The same run's losses are compared.
2. Profile (one process): one forward + backward of the model, eager and compiled, with the
   operators split into GEMMs, attention, and the rest (norms, RoPE, SwiGLU, residuals, copies;
   compiled, the fused kernels). Self CPU time per class.

Prints one JSON document. Usage: python benchmarks/compile_speed.py [--seq 4096] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

LAYOUTS = {"1 process": (1, []), "head 2 x ctx 2": (4, ["--parallel.head=2", "--parallel.ctx=2"])}
GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "_attention")


def train_run(nproc: int, layout: list[str], seq: int, steps: int, compiled: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "longctx", "train", f"--nproc={nproc}", "--model.preset=small-100m",
               f"--train.seq_len={seq}", "--train.global_batch=1", f"--train.steps={steps}",
               "--train.eval_interval=0", "--metrics.log_interval=1", "--metrics.plots=false",
               "--metrics.progress=false", "--data.max_docs=300", f"--train.compile={str(compiled).lower()}",
               f"--train.run_dir={tmp}", *layout]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        recs = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in recs if x["kind"] == "train"]
    return {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in train if x["step"] > 2),
            "losses": [x["loss"] for x in train]}


def _classify(name: str) -> str:
    if name.startswith(GEMM):
        return "gemm"
    if any(a in name for a in ATTENTION):
        return "attention"
    return "elementwise and other"


def profile(seq: int, compiled: bool) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from longctx.config import load_config
    from longctx.models.compile import compile_token_wise_parts
    from longctx.models.llama import build_model

    cfg = load_config(overrides=["--model.preset=small-100m"]).model
    model = build_model(cfg, seed=0)
    if compiled:
        compile_token_wise_parts(model.layers)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # compile and warm up
        model(tokens, labels=tokens).backward()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        model(tokens, labels=tokens).backward()
    seconds: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            key = _classify(ev.key)
            seconds[key] = seconds.get(key, 0.0) + ev.self_cpu_time_total / 1e6
    return {k: round(v, 3) for k, v in sorted(seconds.items())}


def alternate(seq: int, rounds: int) -> dict:
    """One process, two copies of the same model (one with compiled blocks), forward + backward in
    turn, round after round: the ratio of the two is taken within each round, so the drift of a
    shared machine between two separate runs does not enter it."""
    import copy
    import time

    from longctx.config import load_config
    from longctx.models.compile import compile_token_wise_parts
    from longctx.models.llama import build_model

    cfg = load_config(overrides=["--model.preset=small-100m"]).model
    eager = build_model(cfg, seed=0)
    compiled = copy.deepcopy(eager)
    compile_token_wise_parts(compiled.layers)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))

    def timed(model):
        t0 = time.perf_counter()
        model(tokens, labels=tokens).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for model in (eager, compiled):  # compile and warm up
        timed(model)
    pairs = []
    for r in range(rounds):
        first, second = (eager, compiled) if r % 2 == 0 else (compiled, eager)  # neither always goes first
        a, b = timed(first), timed(second)
        pairs.append((a, b) if first is eager else (b, a))
        print(f"round {r}: eager {pairs[-1][0]:.2f}s compiled {pairs[-1][1]:.2f}s", file=sys.stderr, flush=True)
    ratios = [e / c for e, c in pairs]
    return {"rounds": rounds, "eager_s": [e for e, _ in pairs], "compiled_s": [c for _, c in pairs],
            "compiled_speed_vs_eager_per_round": ratios, "median": statistics.median(ratios)}


def _alternate_rank(seq: int, rounds: int, layout: list[str]) -> dict:
    """One rank of `alternate_ranks`: two models built the way training builds them (meta ->
    parallelise (+ compile) -> FSDP -> this rank's shards), forward + backward in turn."""
    import time

    import torch.distributed as dist

    from longctx.config import load_config
    from longctx.job import comm
    from longctx.job.runtime import Runtime
    from longctx.parallel.context.shares import local_batch
    from longctx.train.model import build_training_model

    world = dist.get_world_size()
    base = ["--model.preset=small-100m", f"--train.seq_len={seq}", "--train.global_batch=1", *layout]
    models, rt = {}, None
    for name, flag in (("eager", "false"), ("compiled", "true")):
        cfg = load_config(overrides=[*base, f"--train.compile={flag}"])
        rt = rt or Runtime.create(cfg, dist.get_rank(), world, "cpu")
        models[name] = build_training_model(cfg, torch.device("cpu"), rt, log=lambda *_: None)
    from longctx.data.samples import Batch

    tokens = torch.randint(0, 320, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = local_batch(rt, Batch(tokens, tokens, torch.arange(seq)[None], None))

    def timed(model) -> float:
        comm.barrier(rt.world_mesh)
        t0 = time.perf_counter()
        model(batch.tokens, batch.positions, None, labels=batch.labels).backward()
        model.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        return rt.max([elapsed])[0]  # the slowest rank decides a distributed step

    for model in models.values():  # compile and warm up
        timed(model)
    pairs = []
    for r in range(rounds):
        order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
        got = {name: timed(models[name]) for name in order}
        pairs.append((got["eager"], got["compiled"]))
        if rt.is_main:
            print(f"round {r}: eager {got['eager']:.2f}s compiled {got['compiled']:.2f}s", file=sys.stderr, flush=True)
    return {"eager_s": [e for e, _ in pairs], "compiled_s": [c for _, c in pairs]}


def alternate_ranks(seq: int, rounds: int) -> dict:
    """`alternate` under head 2 x ctx 2 on 4 gloo ranks (FSDP over nothing: dp 1), timed per round
    as the slowest rank's forward + backward."""
    from longctx.job.spawn import run_spawned

    got = run_spawned(4, _alternate_rank, seq, rounds, ["--parallel.head=2", "--parallel.ctx=2"], timeout=3600)[0]
    ratios = [e / c for e, c in zip(got["eager_s"], got["compiled_s"])]
    return {"rounds": rounds, "layout": "head 2 x ctx 2", **got, "compiled_speed_vs_eager_per_round": ratios,
            "median": statistics.median(ratios)}


def rounding(seq: int) -> dict:
    """Where compiled and eager round differently: each token-wise op alone (max |difference| over
    max |eager|, forward and each input's gradient), then one forward + backward of small-100m
    (loss difference, and the gradients' relative L2 difference over all parameters)."""
    import copy

    import torch.nn.functional as F

    from longctx.config import load_config
    from longctx.models.compile import compile_token_wise_parts
    from longctx.models.llama import apply_rope, build_model, rope_cos_sin
    from longctx.ops.norm import rms_norm

    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    def compare(fn, *inputs) -> dict:
        ye = fn(*inputs)
        seed = torch.randn(ye.shape, generator=g)  # the same upstream gradient for both
        ge = torch.autograd.grad(ye, inputs, seed)
        yc = torch.compile(fn)(*inputs)
        gc = torch.autograd.grad(yc, inputs, seed)
        rel = [float((c - e).abs().max() / e.abs().max()) for c, e in zip((yc.detach(), *gc), (ye.detach(), *ge))]
        return {"forward": rel[0], "grads": rel[1:]}

    x, w = leaf(1, seq, 768), leaf(768)
    q = leaf(1, seq, 12, 64)
    a, b = leaf(1, seq, 2048), leaf(1, seq, 2048)
    cos, sin = rope_cos_sin(torch.arange(seq)[None], 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    ops = {}
    for name, fn, inputs in (("rms_norm", lambda x, w: rms_norm(x, w, 1e-5), (x, w)),
                             ("rope", lambda q: apply_rope(q, cos, sin), (q,)),
                             ("swiglu (silu(a) * b)", lambda a, b: F.silu(a) * b, (a, b)),
                             ("residual add", lambda a, b: a + b, (a, b))):
        ops[name] = compare(fn, *inputs)

    cfg = load_config(overrides=["--model.preset=small-100m"]).model
    eager = build_model(cfg, seed=0)
    compiled = copy.deepcopy(eager)
    compile_token_wise_parts(compiled.layers)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    results = []
    for model in (eager, compiled):
        loss = model(tokens, labels=tokens)
        loss.backward()
        results.append((float(loss.detach()), [p.grad.double() for p in model.parameters()]))
    (le, ge), (lc, gc) = results
    num = sum(float(((c - e) ** 2).sum()) for c, e in zip(gc, ge))
    den = sum(float((e ** 2).sum()) for e in ge)
    return {"ops_max_rel_diff": ops, "one_step": {"loss_diff": lc - le, "grad_rel_l2_diff": (num / den) ** 0.5}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--noise-floor", action="store_true",
                   help="instead: how far two eager runs of the same training drift apart when only the rounding "
                        "differs (1 process vs ctx 2 on 2 processes), step by step")
    p.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                   help="instead: one process, eager and compiled forward + backward in turn for ROUNDS rounds")
    p.add_argument("--rounding", action="store_true",
                   help="instead: where compiled and eager round differently, op by op and for one step of the model")
    p.add_argument("--ranks", action="store_true", help="with --alternate: head 2 x ctx 2 on 4 processes")
    a = p.parse_args()
    if a.rounding:
        print(json.dumps({"bench": "compile_speed.rounding", "model": "small-100m", "seq": a.seq,
                          "torch": torch.__version__, **rounding(a.seq)}, indent=2))
        return
    if a.alternate and a.ranks:
        print(json.dumps({"bench": "compile_speed.alternate", "model": "small-100m", "seq": a.seq,
                          "torch": torch.__version__, **alternate_ranks(a.seq, a.alternate)}, indent=2))
        return
    if a.alternate:
        print(json.dumps({"bench": "compile_speed.alternate", "model": "small-100m", "seq": a.seq,
                          "torch": torch.__version__, **alternate(a.seq, a.alternate)}, indent=2))
        return
    if a.noise_floor:
        one = train_run(1, [], a.seq, a.steps, False)
        two = train_run(2, ["--parallel.ctx=2"], a.seq, a.steps, False)
        diffs = [abs(x - y) for x, y in zip(one["losses"], two["losses"])]
        print(json.dumps({"bench": "compile_speed.noise_floor", "model": "small-100m", "seq": a.seq, "steps": a.steps,
                          "torch": torch.__version__, "eager_1_process": one["losses"], "eager_ctx2": two["losses"],
                          "abs_diff_per_step": diffs, "max_loss_diff": max(diffs)}, indent=2))
        return
    out = {"bench": "compile_speed", "model": "small-100m", "seq": a.seq, "steps": a.steps,
           "torch": torch.__version__, "throughput": {}, "profile_s": {}}
    for name, (nproc, layout) in LAYOUTS.items():
        eager = train_run(nproc, layout, a.seq, a.steps, False)
        comp = train_run(nproc, layout, a.seq, a.steps, True)
        out["throughput"][name] = {
            "eager_tokens_per_s": eager["tokens_per_s"], "compiled_tokens_per_s": comp["tokens_per_s"],
            "compiled_vs_eager": comp["tokens_per_s"] / eager["tokens_per_s"],
            "max_loss_diff": max(abs(x - y) for x, y in zip(eager["losses"], comp["losses"])),
            "abs_diff_per_step": [abs(x - y) for x, y in zip(eager["losses"], comp["losses"])]}
        print(json.dumps({name: out["throughput"][name]}), file=sys.stderr, flush=True)
    if not a.skip_profile:
        out["profile_s"] = {"eager": profile(a.seq, False), "compiled": profile(a.seq, True)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
