"""train.dtype = bf16 (bf16 autocast over fp32 weights, CPU) under the parallel layouts: the attention
core and the transfers around it run in bf16 as one process does, and the losses are one process's.

The class of bug: a tensor that autocast leaves fp32 (a q/k RMSNorm's output, the residual stream)
meets a bf16 one in a collective or a torch.stack, which promotes, so a layout silently computes
attention in fp32 while one process computes it in bf16 (tests/unit/test_bf16_numerics_audit.py found
it for the ring's torch.stack([k, v]) with q/k norms). The direct check records, on every rank, the
dtypes the ring, its blocks' kernels (dense and chunked), the Ulysses all-to-alls and the ring's
sends see (the direct check: fp32 and bf16 losses differ by only ~3e-5 relative here); the losses are
checked against the one-process bf16 run (measured within 6e-5 relative; 1e-3 catches a wrong layout).

By design fp32: the ring's travelling dk/dv accumulators (ring.py _block_backward), the MoE router's
counts (int64) and the expert rows dispatched from the fp32 residual stream (autocast casts them at
the experts' matmuls on the receiving rank, as one process does at its own).
"""

import collections
import time

import pytest
import torch.distributed as dist

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.train.trainer import train

STEPS = 2
BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300",
        "--train.seq_len=256", "--train.warmup_steps=2", f"--train.steps={STEPS}", "--train.dtype=bf16",
        # MFU's peak given, not calibrated: the first bf16 run of a session would otherwise measure this CPU's bf16
        # GEMM peak (2048^3 GEMMs: 1-4 min where the CPU has no native bf16), which nothing here reads
        "--metrics.peak_tflops=1"]
QWEN = ["--model.family=qwen3", "--model.qk_norm=true"]  # q/k RMSNorm: fp32 q/k under autocast before the fix
MOE = ["--model.preset=debug-moe"]
LAYOUTS = {  # key -> (model args, layout args)
    "head2-ctx2 qwen3": (QWEN, ["--parallel.head=2", "--parallel.ctx=2"]),
    "ctx4 qwen3 chunked offload": (QWEN, ["--parallel.ctx=4", "--memory.attention_chunk=32",
                                          "--memory.offload_fraction=0.5", "--memory.recompute=selective"]),
    "expert2-ctx2 moe": (MOE, ["--parallel.expert=2", "--parallel.ctx=2"]),
}


def _instrumented_train(args, run_dir):
    """(losses, {(site, dtypes...): calls}) of a bf16 run, recording the dtypes of each site."""
    import longctx.ops.chunked as chunked
    import longctx.parallel.context.attention as attention
    import longctx.parallel.context.ring as ring

    seen = collections.Counter()

    def wrap(site, fn, pick):
        def recorded(*a, **kw):
            seen[(site, *pick(a))] += 1
            return fn(*a, **kw)
        return recorded

    qkv = lambda a: tuple(str(t.dtype) for t in a[:3])  # noqa: E731
    sites = [(attention, "ring_attention", "ring", qkv),
             (ring, "attention_forward", "block forward", qkv),
             (ring, "attention_backward", "block backward", lambda a: qkv(a[1:])),
             (chunked, "attention_forward", "chunk forward", qkv),
             (chunked, "attention_backward", "chunk backward", lambda a: qkv(a[1:])),
             (dist, "all_to_all_single", "all_to_all", lambda a: (str(a[1].dtype),)),
             (dist, "batch_isend_irecv", "send/recv", lambda a: tuple(sorted({str(op.tensor.dtype) for op in a[0]})))]
    saved = [(m, name, getattr(m, name)) for m, name, _, _ in sites]
    for (m, name, site, pick), (_, _, fn) in zip(sites, saved):
        setattr(m, name, wrap(site, fn, pick))
    try:
        cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
        return train(cfg, log=lambda *a, **k: None).losses, dict(seen)
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("bf16-layouts")
    single = {key: _instrumented_train([*BASE, *model], str(base / f"single-{i}"))[0]
              for i, (key, (model, _)) in enumerate(LAYOUTS.items())}
    jobs = [(key, _instrumented_train, ([*BASE, *model, *layout], str(base / f"ranks-{i}-{time.time_ns()}")))
            for i, (key, (model, layout)) in enumerate(LAYOUTS.items())]
    return single, run_spawned_many(4, jobs)


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_bf16_layout_computes_attention_in_bf16_and_matches_one_process(key, runs):
    single, ranks = runs
    for losses, seen in ranks[key]:
        cores = {k: n for k, n in seen.items() if k[0] in ("ring", "block forward", "block backward",
                                                           "chunk forward", "chunk backward")}
        assert cores, f"{key}: no attention core call recorded"
        promoted = {k: n for k, n in cores.items() if set(k[1:]) != {"torch.bfloat16"}}
        assert not promoted, f"{key}: attention q/k/v not all bf16 under bf16 autocast: {promoted}"
        # the Ulysses all-to-alls carry bf16 q/k/v/out (and int64 counts, fp32/bf16 rows under EP)
        if "head2" in key:
            assert seen.get(("all_to_all", "torch.bfloat16"), 0) > 0 and ("all_to_all", "torch.float32") not in seen
        # the ring's k/v blocks travel in bf16 (the backward's fp32 dk/dv accumulators by design)
        assert seen.get(("send/recv", "torch.bfloat16"), 0) > 0, f"{key}: {seen}"
        diffs = [abs(a - b) / b for a, b in zip(losses, single[key])]
        assert len(losses) == STEPS and max(diffs) <= 1e-3, f"{key}: relative |loss - one process bf16| = {diffs}"
