"""2D sequence-parallel attention against single-device attention, on gloo processes.

One spawn per world size (fixture `spawned`, run_spawned_many: the fp32 cases, and at 4 and 8
ranks the packed-document layouts, at 8 the bf16 ring); inside it every layout (head x ctx
factorisation, window, placement) and every case (causal or not, kv heads, packed documents) runs.
Also checks the byte counters against the closed-form volumes.
"""

import itertools

import pytest
import torch

from longctx.job import comm
from longctx.job.dims import ParallelDims
from longctx.job.spawn import run_spawned_many
from longctx.ops.attention import attention
from longctx.parallel.context.attention import distributed_attention
from longctx.parallel.context.sequence import shard_sequence
from longctx.parallel.context.volumes import attention_bytes

B, H, D = 2, 8, 16


def layouts(world):
    for head in [d for d in range(1, world + 1) if world % d == 0]:
        ctx = world // head
        for window in sorted({0} | ({2} if ctx > 2 and ctx % 2 == 0 else set())):
            for placement in ("head-first", "ctx-first") if head > 1 and ctx > 1 else ("head-first",):
                yield head, ctx, window, placement


def make_docs(seq, world):
    """Document ids with boundaries inside every rank's chunks and one tiny document."""
    doc = torch.zeros(B, seq, dtype=torch.long)
    cuts = [[3, 4, seq // 3 + 1, seq - 5], [seq // 2 + 3]]
    for row, row_cuts in enumerate(cuts):
        for c in row_cuts:
            doc[row, c:] += 1
    return doc


def run_cases(world, seq, dtype_name, cases):
    """Runs on every rank; returns a list of (case, out_err, grad_err, counters_ok, detail)."""
    dtype = getattr(torch, dtype_name)
    rank = torch.distributed.get_rank()
    meshes = {}
    refs = {}  # the single-device reference of a (causal, kv, docs) input, the same for every layout
    results = []
    for head, ctx, window, placement, causal, kv, docs in cases:
        key = (head, ctx, window, placement)  # a Double-Ring window opens its outer lane with the mesh
        if key not in meshes:
            meshes[key] = ParallelDims(dp_shard=1, head=head, ctx=ctx, window=window, placement=placement,
                                       world_size=world).build_mesh("cpu")
        mesh = meshes[key]
        gen = torch.Generator().manual_seed(1000 + seq + kv)
        q = torch.randn(B, seq, H, D, generator=gen)
        k = torch.randn(B, seq, kv, D, generator=gen)
        v = torch.randn(B, seq, kv, D, generator=gen)
        dout = torch.randn(B, seq, H, D, generator=gen)
        doc = make_docs(seq, world) if docs else None
        if (causal, kv, docs) not in refs:
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            ref, _ = attention(qr, kr, vr, causal=causal, q_doc=doc, k_doc=doc, backend="math")
            refs[causal, kv, docs] = ref, torch.autograd.grad((ref * dout).sum(), (qr, kr, vr))
        ref, ref_grads = refs[causal, kv, docs]

        ql, kl, vl = (shard_sequence(t, mesh).to(dtype).requires_grad_() for t in (q, k, v))
        dl = shard_sequence(doc, mesh) if docs else None
        comm.reset_counters()
        out = distributed_attention(ql, kl, vl, mesh, causal=causal, doc_ids=dl, window=window)
        grads = torch.autograd.grad((out.float() * shard_sequence(dout, mesh)).sum(), (ql, kl, vl))
        out_err = (out.float() - shard_sequence(ref, mesh)).abs().max().item()
        grad_err = max((g.float() - shard_sequence(r, mesh)).abs().max().item() for g, r in zip(grads, ref_grads))
        sent = comm.counters()
        expected = attention_bytes(seq=seq, batch=B, heads=H, kv_heads=kv, head_dim=D, head=head, ctx=ctx,
                                   elem=torch.empty(0, dtype=dtype).element_size(), docs=docs)
        results.append(((head, ctx, window, placement, causal, kv, docs), out_err, grad_err, sent == expected,
                        f"rank {rank} sent {sent}, expected {expected}"))
    return results


def all_cases(world):
    # every kv-head count up to 4 ranks; at 8 ranks (108 cases otherwise), kv = 2 is left out: kv = 1
    # (replicated on every head rank) and kv = H (split) bracket it, and 4 ranks run it
    kvs = (1, H) if world == 8 else (1, 2, H)
    for (head, ctx, window, placement), causal, kv, docs in itertools.product(
            layouts(world), (True, False), kvs, (False, True)):
        yield head, ctx, window, placement, causal, kv, docs


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_fp32_parity_and_byte_counts(world, spawned):
    per_rank = spawned(world)["fp32"]
    failures = []
    for rank_results in per_rank:
        for case, out_err, grad_err, counters_ok, detail in rank_results:
            if out_err > 1e-5 or grad_err > 1e-4 or not counters_ok:
                failures.append(f"{case}: out {out_err:.2e} grad {grad_err:.2e} {'' if counters_ok else detail}")
    assert not failures, f"{len(failures)} failing cases, e.g.:\n" + "\n".join(failures[:8])


def single_device_bf16_error(seq, kv, docs):
    """Error of ONE bf16 attention call over the whole sequence against fp32: the bf16 rounding floor."""
    gen = torch.Generator().manual_seed(1000 + seq + kv)
    q = torch.randn(B, seq, H, D, generator=gen)
    k = torch.randn(B, seq, kv, D, generator=gen)
    v = torch.randn(B, seq, kv, D, generator=gen)
    dout = torch.randn(B, seq, H, D, generator=gen)
    doc = make_docs(seq, 8) if docs else None
    errs = []
    for dtype in (torch.float32, torch.bfloat16):
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        out, _ = attention(qq, kk, vv, q_doc=doc, k_doc=doc)
        grads = torch.autograd.grad((out.float() * dout).sum(), (qq, kk, vv))
        errs.append((out.float(), [g.float() for g in grads]))
    (o32, g32), (o16, g16) = errs
    return (o16 - o32).abs().max().item(), max((a - b).abs().max().item() for a, b in zip(g16, g32))


BF16_SEQ = 128
BF16_CASES = [(1, 8, 0, "head-first", True, 2, False), (1, 8, 2, "head-first", True, 2, True)]


def test_bf16_merge_stays_within_bf16_rounding(spawned):
    """ctx = 8 ring in bf16: partial results merge in fp32, so the error stays that of bf16 inputs
    (compared with one bf16 attention call over the whole sequence), not growing with the ring."""
    world, seq = 8, BF16_SEQ
    per_rank = spawned(world)["bf16"]
    worst_out = max(r[1] for rank_results in per_rank for r in rank_results)
    worst_grad = max(r[2] for rank_results in per_rank for r in rank_results)
    floor_out, floor_grad = (max(x) for x in zip(*(single_device_bf16_error(seq, 2, d) for d in (False, True))))
    print(f"bf16 ctx=8: ring max err out {worst_out:.3e} grads {worst_grad:.3e}; "
          f"single-device bf16 out {floor_out:.3e} grads {floor_grad:.3e}")
    assert worst_out <= 2 * floor_out and worst_grad <= 2 * floor_grad


# ----------------------------------------------------------------------------------------------
# Packed documents in a SequenceLayout (plan_layout): both seq_balance choices (docs, zigzag), random documents


def random_docs(seq, seed):
    """[B, seq] document ids: random lengths with length-1 documents, one document longer than a rank's
    share, a stretch of 1,000+ tiny documents (seq >= 4096) and trailing padding as its own document."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for r in range(B):
        lengths = []
        if r == 0:
            lengths.append(seq // 2 + 7)  # longer than any rank's share
        if seq >= 4096 and r == 1:
            lengths += [2] * 1100  # 1,100 tiny documents
        while sum(lengths) < seq - 8:
            lengths.append(int(rng.choice([1, 1, 2, 5, 13, int(rng.integers(20, seq // 4))])))
        lengths = lengths[:-1] if sum(lengths) > seq - 3 else lengths
        lengths.append(seq - sum(lengths))  # the rest: trailing padding, a document of its own
        rows.append(np.repeat(np.arange(len(lengths)), lengths)[:seq])
    return torch.from_numpy(np.stack(rows))


def run_layout_cases(world, seq, cases):
    from longctx.parallel.context.sequence import plan_layout

    results = []
    meshes = {}
    refs = {}  # the single-device reference of a (kv, seed) input, the same for every layout and balance
    for head, ctx, window, placement, kv, balance, seed in cases:
        key = (head, ctx, window, placement)  # a Double-Ring window opens its outer lane with the mesh
        if key not in meshes:
            meshes[key] = ParallelDims(dp_shard=1, head=head, ctx=ctx, window=window, placement=placement,
                                       world_size=world).build_mesh("cpu")
        mesh = meshes[key]
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, seq, n, D, generator=gen) for n in (H, kv, kv))
        dout = torch.randn(B, seq, H, D, generator=gen)
        doc = random_docs(seq, seed)
        if (kv, seed) not in refs:
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            ref, _ = attention(qr, kr, vr, causal=True, q_doc=doc, k_doc=doc)
            refs[kv, seed] = ref, torch.autograd.grad((ref * dout).sum(), (qr, kr, vr))
        ref, ref_grads = refs[kv, seed]
        layout = plan_layout(doc, ctx, head, balance=balance)
        ql, kl, vl = (layout.shard(t, mesh).requires_grad_() for t in (q, k, v))
        comm.reset_counters()
        out = distributed_attention(ql, kl, vl, mesh, causal=True, doc_ids=layout.shard(doc, mesh), layout=layout)
        grads = torch.autograd.grad((out * layout.shard(dout, mesh)).sum(), (ql, kl, vl))
        sent = comm.counters()
        expected = attention_bytes(seq=seq, batch=B, heads=H, kv_heads=kv, head_dim=D, head=head, ctx=ctx, elem=4)
        full_out = layout.unshard(out.detach(), mesh)  # the exact inverse of shard
        results.append(((head, ctx, window, placement, kv, balance, seed),
                        (full_out - ref).abs().max().item(),
                        max((g - layout.shard(r, mesh)).abs().max().item() for g, r in zip(grads, ref_grads)),
                        sent == expected, f"sent {sent}, expected {expected}"))
    return results


def layout_cases(world):
    return [(head, ctx, window, placement, kv, balance, seed)
            for head, ctx, window, placement in layouts(world) if ctx > 1
            for kv, balance, seed in ((2, "docs", 1), (H, "zigzag", 2), (1, "docs", 3))]


DOC_SEQ = {4: 512, 8: 4096}  # world -> sequence length of the packed-document cases


@pytest.mark.parametrize("world,seq", list(DOC_SEQ.items()))
def test_documents_in_a_layout_are_exact(world, seq, spawned):
    per_rank = spawned(world)["docs"]
    failures = [f"{case}: out {o:.2e} grad {g:.2e} {'' if ok else detail}"
                for rank_results in per_rank for case, o, g, ok, detail in rank_results
                if o > 1e-5 or g > 1e-4 or not ok]
    assert not failures, f"{len(failures)} failing cases, e.g.:\n" + "\n".join(failures[:8])


# ----------------------------------------------------------------------------------------------
# one spawned job per world size


def _jobs(world):
    jobs = [("fp32", run_cases, (world, 64, "float32", list(all_cases(world))))]
    if world == 8:
        jobs.append(("bf16", run_cases, (world, BF16_SEQ, "bfloat16", BF16_CASES)))
    if world in DOC_SEQ:
        jobs.append(("docs", run_layout_cases, (world, DOC_SEQ[world], layout_cases(world))))
    return jobs


@pytest.fixture(scope="module")
def spawned():
    """spawned(world) -> {"fp32" | "bf16" | "docs": per-rank results}: every case of that world size in
    one job, run on first use."""
    done = {}

    def get(world):
        if world not in done:
            done[world] = run_spawned_many(world, _jobs(world))
        return done[world]

    return get
