"""Randomized (seeded) audit of 2D sequence parallelism (Ulysses x ring) with packed documents over 4 gloo
ranks, against single-device references, every group of cases in one spawned job (about 25 s on 2 cores).

Every mesh of 4 ranks (head 4, ctx 4, head 2 x ctx 2, both placements), plain ring and Double-Ring windows,
the zigzag and document-balanced splits, ids sharded zigzag with no layout or a layout given or attached as
training does, attention chunks, attention offload; query heads over kv heads fewer than the head degree
(replicated); rows with documents of length 1, documents shorter than a zigzag chunk, one document over every
context rank, ids numbered out of order (tests/ringdoc_fuzz120_reference.py draws them). Compared: the output and
the q, k, v gradients of every rank's shard with float64 attention (tests/attention_reference.py), to 2e-5; for a
tiny llama, the summed loss and every parameter's gradient (summed over the ranks) with one process's.
What cannot run is refused alike on every rank before any communication, and the group still works after:
kv heads the head degree cannot split, a sequence not a multiple of 2 x ctx x head. A sequence padded
explicitly to one (the padding its own document, or the last one's with no gradient from it) gives the
unpadded sequence's attention on its real tokens.
"""

import numpy as np
import pytest
import torch

from attention_reference import dense_reference
from longctx.job.spawn import run_spawned_many
from ringdoc_fuzz120_reference import (
    MESHES,
    ROUTES,
    WORLD,
    draw_case,
    draw_model_case,
    ids_of,
    model_batch,
    model_reference,
    tiny_llama,
)

TOL, MODEL_TOL = 2e-5, 2e-5
CASES, MODEL_CASES = range(18), range(5)


def _mesh(meshes: dict, head: int, ctx: int, window: int = 0, placement: str = "head-first"):
    from longctx.job.dims import ParallelDims

    key = (head, ctx, window, placement)
    if key not in meshes:
        meshes[key] = ParallelDims(dp_shard=1, head=head, ctx=ctx, window=window, placement=placement,
                                   world_size=WORLD).build_mesh("cpu")
    return meshes[key]


def _sharding(case: dict, doc: torch.Tensor, mesh, route: str):
    """(shard function, this rank's ids, extra keyword arguments of distributed_attention) for a route."""
    from longctx.parallel.context.sequence import attach_layout, plan_layout, shard_sequence

    if route == "zigzag ids":
        return (lambda t: shard_sequence(t, mesh)), shard_sequence(doc, mesh), {}
    layout = plan_layout(doc, case["ctx"], case["head"], balance="zigzag" if route == "zigzag layout" else "docs")
    local = layout.shard(doc, mesh)
    if route == "attached docs layout":  # as local_batch hands the ids to the model
        return (lambda t: layout.shard(t, mesh)), attach_layout(local, layout), {}
    return (lambda t: layout.shard(t, mesh)), local, {"layout": layout}


def attention_case(case: dict, meshes: dict) -> tuple[float, float]:
    """(largest output error, largest q, k, v gradient error) of this rank's shard against float64."""
    from longctx.parallel.context.attention import distributed_attention

    mesh = _mesh(meshes, case["head"], case["ctx"], case["window"], case["placement"])
    gen = torch.Generator().manual_seed(case["seed"])
    b, s, d = len(case["rows"]), case["seq"], case["head_dim"]
    q, k, v, dout = (torch.randn(b, s, n, d, generator=gen) for n in (case["heads"], case["kv"], case["kv"],
                                                                    case["heads"]))
    doc = ids_of(case["rows"], np.random.default_rng(case["seed"]))
    ref_out, ref_grads = dense_reference(q, k, v, doc, dout)
    shard, local_doc, extra = _sharding(case, doc, mesh, case["route"])
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = distributed_attention(ql, kl, vl, mesh, causal=True, doc_ids=local_doc, window=case["window"],
                                attention_chunk=case["chunk"], attention_offload=case["offload"], **extra)
    grads = torch.autograd.grad((out * shard(dout)).sum(), (ql, kl, vl))
    return ((out.double() - shard(ref_out)).abs().max().item(),
            max((g.double() - shard(r)).abs().max().item() for g, r in zip(grads, ref_grads)))


def attention_cases(seeds) -> list:
    meshes = {}
    return [(seed, attention_case(draw_case(seed), meshes)) for seed in seeds]


# ----------------------------------------------------------------------------------------------
# Refused alike on every rank, and padded explicitly


def _refused(call, *args, **kwargs) -> str:
    """The refusal's type and message ('' when `call(*args, **kwargs)` ran)."""
    try:
        call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (the test reads which)
        return f"{type(e).__name__}: {e}"
    return ""


def refusals() -> tuple[dict, dict]:
    """({what: the refusal's 'Type: message'} for layouts that cannot run, {what: error against float64} of a
    valid call on the same mesh after them: a rank that had gone on to communicate would leave the others' next
    call hung or wrong)."""
    from longctx.parallel.context.attention import distributed_attention
    from longctx.parallel.context.sequence import plan_layout, shard_sequence

    meshes, seen, after = {}, {}, {}
    for head, ctx in MESHES:
        mesh = _mesh(meshes, head, ctx)
        unit = 2 * head * ctx
        for heads, kv in ((3 * head, 3), (6 * head, 3)):
            if kv % head and head % kv:  # neither splits the other: no replication makes the heads fit
                q, kv_t = torch.randn(1, 4, heads, 4), torch.randn(1, 4, kv, 4)
                seen[f"heads {heads} kv {kv} over head {head} x ctx {ctx}"] = _refused(
                    distributed_attention, q, kv_t, kv_t, mesh)
        odd = unit + unit // 2  # not a multiple of 2 x ctx x head
        doc = torch.zeros(1, odd, dtype=torch.long)
        seen[f"shard {odd} tokens over head {head} x ctx {ctx}"] = _refused(shard_sequence, doc, mesh)
        seen[f"docs layout of {odd} tokens over head {head} x ctx {ctx}"] = _refused(
            plan_layout, doc, ctx, head, balance="docs")
        local = odd // (head * ctx)
        if local * head * ctx == odd:  # a local shard that exists, but is odd: the zigzag halves do not
            t = torch.randn(1, local, head, 4)
            seen[f"local shard {local} over head {head} x ctx {ctx}"] = _refused(distributed_attention, t, t, t, mesh)
            seen[f"local shard {local} with ids over head {head} x ctx {ctx}"] = _refused(
                distributed_attention, t, t, t, mesh, doc_ids=torch.zeros(1, local, dtype=torch.long))
        gen = torch.Generator().manual_seed(unit)  # (the same tensors on every rank: their seeds differ)
        q, k, v = (torch.randn(1, 2 * unit, 2 * head, 4, generator=gen) for _ in range(3))  # one document, no ids
        out = distributed_attention(*(shard_sequence(t, mesh) for t in (q, k, v)), mesh)
        after[f"one document over head {head} x ctx {ctx}"] = (
            out.double() - shard_sequence(dense_reference(q, k, v, None, q)[0], mesh)).abs().max().item()
    return seen, after


def padded_case(head: int, ctx: int, real: int, own_document: bool, meshes: dict) -> tuple[float, float]:
    """A row of `real` tokens padded to the next multiple of 2 x ctx x head, the padding its own document (or the
    last document's, its output given no gradient): (output error, gradient error) on the real tokens against
    float64 attention over the unpadded row."""
    from longctx.parallel.context.attention import distributed_attention
    from longctx.parallel.context.sequence import plan_layout

    mesh = _mesh(meshes, head, ctx)
    unit = 2 * head * ctx
    seq = -(-real // unit) * unit
    gen = torch.Generator().manual_seed(real + unit)
    q, k, v, dout = (torch.randn(1, seq, 2 * head, 4, generator=gen) for _ in range(4))
    doc = ids_of([[3, 1, real - 4]], np.random.default_rng(real))
    pad_id = int(doc.max()) + 1 if own_document else int(doc[0, -1])
    doc = torch.cat([doc, torch.full((1, seq - real), pad_id)], dim=1)
    dout[:, real:] = 0  # padding is masked out of the loss
    ref_out, ref_grads = dense_reference(q[:, :real], k[:, :real], v[:, :real], doc[:, :real], dout[:, :real])
    layout = plan_layout(doc, ctx, head, balance="docs")
    ql, kl, vl = (layout.shard(t, mesh).requires_grad_() for t in (q, k, v))
    out = distributed_attention(ql, kl, vl, mesh, doc_ids=layout.shard(doc, mesh), layout=layout)
    grads = torch.autograd.grad((out * layout.shard(dout, mesh)).sum(), (ql, kl, vl))
    full_out, full_grads = layout.unshard(out.detach(), mesh), [layout.unshard(g, mesh) for g in grads]
    return ((full_out[:, :real].double() - ref_out).abs().max().item(),
            max((g[:, :real].double() - r).abs().max().item() for g, r in zip(full_grads, ref_grads)))


def padded_cases() -> dict:
    meshes = {}
    return {(head, ctx, real, own): padded_case(head, ctx, real, own, meshes)
            for head, ctx in MESHES for real in (13, 2 * head * ctx + 1) for own in (True, False)}


# ----------------------------------------------------------------------------------------------
# The tiny llama: loss and parameter gradients


def model_case(case: dict, meshes: dict):
    """(summed loss over every rank, {name: gradient summed over the ranks} on rank 0) of the tiny llama with
    2D sequence-parallel attention, each rank holding its share of the rows (the layout on its ids)."""
    from longctx.job.dims import ParallelDims
    from longctx.parallel.context.sequence import attach_layout, plan_layout
    from longctx.parallel.parallelize import use_sequence_parallel_attention

    mesh = _mesh(meshes, case["head"], case["ctx"], case["window"], case["placement"])
    dims = ParallelDims(dp_shard=1, head=case["head"], ctx=case["ctx"], window=case["window"],
                        placement=case["placement"], world_size=WORLD)
    model = tiny_llama(case["kv"])
    use_sequence_parallel_attention(model, dims, mesh)
    tokens, labels, positions, doc = model_batch(case)
    layout = plan_layout(doc, case["ctx"], case["head"], balance=case["balance"])
    tl, ll, pl, dl = (layout.shard(t, mesh) for t in (tokens, labels, positions, doc))
    loss = model(tl, pl, attach_layout(dl, layout), labels=ll, loss_reduction="sum")
    loss.backward()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad)
    grads = {k: p.grad.numpy().copy() for k, p in model.named_parameters()}
    return float(total), grads if torch.distributed.get_rank() == 0 else None


def model_cases(seeds) -> list:
    meshes = {}
    return [(seed, model_case(draw_model_case(seed), meshes)) for seed in seeds]


# ----------------------------------------------------------------------------------------------
# The jobs and the tests


@pytest.fixture(scope="module")
def spawned():
    """Every group of cases in one spawned job of 4 ranks (about 25 s on 2 shared cores)."""
    return run_spawned_many(WORLD, [("attention", attention_cases, (list(CASES),)), ("refusals", refusals, ()),
                                    ("padded", padded_cases, ()), ("model", model_cases, (list(MODEL_CASES),))])


def _failures(per_rank) -> list[str]:
    return [f"rank {rank}: {draw_case(seed)}: out {errors[0]:.2e}, grads {errors[1]:.2e}"
            for rank, results in enumerate(per_rank) for seed, errors in results if max(errors) > TOL]


def test_cases_cover_the_edges():
    cases = [draw_case(s) for s in CASES]
    assert {(c["head"], c["ctx"]) for c in cases} == set(MESHES)
    assert {c["route"] for c in cases} == set(ROUTES)
    assert {c["window"] for c in cases if c["ctx"] == 4} >= {0, 2}  # plain ring and Double-Ring
    assert {c["placement"] for c in cases if c["ctx"] == c["head"] == 2} == {"head-first", "ctx-first"}
    assert any(c["kv"] < c["head"] for c in cases)  # kv heads replicated over the head group
    assert any(c["chunk"] for c in cases) and any(not c["chunk"] for c in cases)
    for c in cases:
        chunk = c["seq"] // (2 * c["ctx"])
        assert all(1 in row and min(row) < chunk for row in c["rows"]), c
    spans = [c for c in cases if any(max(row) > c["seq"] - 2 * c["seq"] // (2 * c["ctx"]) for row in c["rows"])]
    assert len(spans) >= 3  # a document over every context rank, under either split
    models = [draw_model_case(s) for s in MODEL_CASES]
    assert {(c["head"], c["ctx"]) for c in models} == set(MESHES) and any(c["kv"] < c["head"] for c in models)
    assert {c["window"] for c in models if c["ctx"] == 4} == {0, 2}


def test_attention_matches_the_dense_reference(spawned):
    failures = _failures(spawned["attention"])
    assert not failures, "\n".join(failures[:6])


def test_impossible_layouts_are_refused_alike_on_every_rank(spawned):
    per_rank = spawned["refusals"]
    assert all(r[0] == per_rank[0][0] for r in per_rank[1:]), "the ranks refused differently"
    seen = per_rank[0][0]
    assert seen and all(seen.values()), {k: v for k, v in seen.items() if not v}
    for rank, (_, after) in enumerate(per_rank):
        assert after and max(after.values()) <= TOL, (rank, after)
    for what, refusal in seen.items():
        assert refusal.startswith("ConfigError"), (what, refusal)
        if what.startswith("heads"):
            assert "cannot be split over head-parallel degree" in refusal, refusal
        else:
            assert "2 x ctx x head" in refusal and ("pad" in refusal or "Use" in refusal), refusal


def test_explicit_padding_gives_the_unpadded_attention(spawned):
    for rank, results in enumerate(spawned["padded"]):
        bad = {key: errors for key, errors in results.items() if max(errors) > TOL}
        assert not bad, f"rank {rank}: (head, ctx, real tokens, padding its own document): {bad}"


def test_tiny_llama_loss_and_gradients_match_one_process(spawned):
    for seed, (loss, grads) in spawned["model"][0]:
        case = draw_model_case(seed)
        ref_loss, ref_grads = model_reference(case)
        assert abs(loss - ref_loss) <= MODEL_TOL * max(1.0, abs(ref_loss)), (case, loss, ref_loss)
        for name, ref in ref_grads.items():
            err = float(np.abs(grads[name] - ref.numpy()).max())
            scale = max(float(ref.abs().max()), 1e-6)
            assert err <= MODEL_TOL * scale + 1e-7, (case, name, err, scale)


@pytest.mark.parametrize("head, ctx, heads, kv, seq_len, words", [
    (1, 4, 4, 2, 100, "use 96 or 104, or pad explicitly"),                  # 100 over 2 x ctx 4 = 8
    (2, 2, 4, 2, 100, "2 x ctx x head = 2 x 2 x 2 = 8"),
    (4, 1, 12, 3, 96, "3 key/value heads cannot be split over head-parallel degree 4"),
    (2, 2, 6, 3, 96, "3 key/value heads cannot be split over head-parallel degree 2"),
])
def test_layouts_that_cannot_run_are_refused_before_launch(head, ctx, heads, kv, seq_len, words):
    """The same rules, from a config, before any process starts (job/checks.py check_layout); kv heads fewer
    than the head degree that divide it are fine (replicated)."""
    from longctx.config import load_config
    from longctx.errors import ConfigError
    from longctx.job.checks import check_layout

    def config(heads, kv, seq_len):
        return load_config(None, ["--train.global_batch=4", f"--parallel.head={head}", f"--parallel.ctx={ctx}",
                                  f"--model.heads={heads}", f"--model.kv_heads={kv}", f"--model.dim={8 * heads}",
                                  f"--train.seq_len={seq_len}"])

    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        check_layout(config(heads, kv, seq_len), WORLD)
    assert check_layout(config(4 * head, 1, 2 * head * ctx * 12), WORLD).head == head  # kv 1 < head: replicated
