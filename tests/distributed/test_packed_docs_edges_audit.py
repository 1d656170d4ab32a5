"""Packed documents at their edges, under every context-parallel layout, against an independent float64
reference that runs each document on its own, unpacked (gloo ranks, tiny model).

The reference shares no code with longctx's attention, sharding or data path: a float64 copy of the model
whose attention core is textbook causal softmax over ONE document (no document ids, positions 0..L-1), run
document by document (those of one length as the rows of one batch); a document's last token predicts nothing
(the next document's first token is no label, data/samples.py), padding predicts nothing, and the loss is the
mean over every labelled token of the step.

The store is written here by hand (segment lengths chosen, random tokens), so the rows hold the edges:
single-token documents, runs of 1-3 token documents, documents that end exactly at a zigzag chunk, a rank's
share, a ring round and an attention (FPDT) chunk, documents of exactly a rank's share, one document across
every rank, one of 90% of the sequence with tiny ones after it, trailing padding. Each layout the config offers
(head, ring zigzag, document-balanced split, Double-Ring windows, head x ctx both placements, attention chunks,
data parallel with micro-batches; the varlen glue through contract fakes of the CUDA kernels) reads its share
with read_local_batch and is compared token by token (the positions, labels, logits and per-token losses it
holds), in its summed loss and in its all-reduced gradients; the training loop itself (train()) is compared in
its step loss, gradient norm and eval loss under grad_accum and dp x head x ctx.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from longctx.job.spawn import run_spawned_many

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320  # the byte tokenizer's 258 ids fit (train() checks the store's tokenizer against the model)
SHORT, LONG = 512, 2048
TOL = 2e-5  # fp32 ranks against float64: logits, per-token losses, the loss; gradients relative to their max


def edge_rows(s: int) -> list[list[int]]:
    """Segment lengths of each sample (a sum below s leaves the rest as padding)."""
    big = int(s * 0.9)
    return [
        [1] * 5 + [2, 3, 1, 2, 3] * 4 + [s - 5 - 44],   # single-token and tiny documents, then a long one
        [s // 8, s // 8, s // 4, s // 2],              # ends at zigzag chunks (ctx 4), shares, half the sequence
        [s - 1, 1],                                   # across every rank, then a one-token document
        [big] + [1, 2, 3] * ((s - big) // 6),          # one of 90% and tiny ones, then padding
        [s // 4] * 4,                                 # each exactly a rank's share (world 4)
        [s // 2 - 28, 50],                            # a padded tail of nearly half the sequence
        [1, s - 2, 1],
        [3] * (s // 3),                               # 3-token documents (682 at LONG: the balance's tail fill)
    ]


EVAL_ROWS = [[1, 1, SHORT - 2], [SHORT // 2, SHORT // 2], [7] * 70, [SHORT]] * 2


# ----------------------------------------------------------------------------------------------
# The store, written by hand


def _write_split(part: Path, split: str, seq: int, rows, rng) -> tuple[np.ndarray, dict]:
    tokens = rng.integers(0, 258, size=(len(rows), seq)).astype(np.uint16)
    segments, pointer, doc, total = [], [0], 0, 0
    for sample, lengths in enumerate(rows):
        offset = 0
        for n in lengths:
            segments.append([sample, offset, n, doc, 0])
            offset, doc = offset + n, doc + 1
        assert offset <= seq
        tokens[sample, offset:] = 257  # the pad token
        total += offset
        pointer.append(len(segments))
    np.save(part / f"{split}.tokens.npy", tokens)
    np.save(part / f"{split}.segments.npy", np.array(segments, dtype=np.int64).reshape(-1, 5))
    np.save(part / f"{split}.samples.npy", np.array(pointer, dtype=np.int64))
    return tokens, {"samples": len(rows), "tokens": total}


def write_store(root: Path, seq: int, rows, eval_rows=(), seed: int = 0):
    """A one-part store of these segments (store.py's format); its train and eval token arrays."""
    part = root / "part-00000"
    part.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    train, t = _write_split(part, "train", seq, rows, rng)
    evals, e = _write_split(part, "eval", seq, eval_rows, rng) if eval_rows else (None, {"samples": 0, "tokens": 0})
    tokenizer = {"spec": "byte", "name": "byte", "identity": "byte", "vocab_size": 258, "eos_id": 257, "pad_id": 257,
                 "text_prefix": []}
    manifest = {"format": "longctx-store", "version": 2, "seq_len": seq, "strategy": "bfd", "tokenizer": tokenizer,
                "token_dtype": "uint16", "packing": {"train": {"fill_rate": 1.0}},
                "totals": {"documents": 0, "duplicates_removed": 0, "tokens": t["tokens"] + e["tokens"],
                           "train_samples": t["samples"], "eval_samples": e["samples"]},
                "parts": [{"dir": part.name, "first_doc": 0, "splits": {"train": t, "eval": e}}]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return train, evals


# ----------------------------------------------------------------------------------------------
# The reference: each document alone, float64


def model_cfg():
    from longctx.config.schema import ModelConfig

    return ModelConfig(dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=64, vocab_size=VOCAB)


def textbook_core(q, k, v, doc_ids):
    """Causal softmax attention over one whole document, float64 (query head i reads kv head i // group)."""
    assert doc_ids is None
    s, h, d = q.shape[1:]
    g = torch.arange(h) // (h // k.shape[2])
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k[:, :, g].double()) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v[:, :, g].double())


def reference(tokens: np.ndarray, rows, doc_mask: bool = True) -> dict:
    """Per token of every sample [n, seq]: position, label (-100: none), logits (NaN at padding), loss; the
    mean loss over the labels, the labels' count and the gradients of that mean."""
    from longctx.models.llama import build_model

    model = build_model(model_cfg(), seed=0).double()  # train.seed 0: the weights train() starts from
    for block in model.layers:
        block.attention.core = textbook_core
    n, seq = tokens.shape
    out = {"positions": np.zeros((n, seq), np.int64), "labels": np.full((n, seq), -100, np.int64),
           "logits": np.full((n, seq, VOCAB), np.nan), "nll": np.full((n, seq), np.nan)}
    # documents of one length run together, one per batch row (the core and the model treat rows apart): the
    # same per-document forward as one at a time, without a forward call per tiny document
    where_of = {}  # length -> [(sample, offset)]
    for r in range(n):
        offset = 0
        for length in (rows[r] if doc_mask else [sum(rows[r])]):
            where_of.setdefault(length, []).append((r, offset))
            offset += length
        # the padding: a document of its own with document masks, else the sequence goes on
        out["positions"][r, offset:] = np.arange(seq - offset) + (0 if doc_mask else offset)
    losses = []
    for length, where in where_of.items():
        docs = torch.from_numpy(np.stack([tokens[r, o:o + length] for r, o in where]).astype(np.int64))
        logits = model(docs)
        # every token but the document's last has a label
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), docs[:, 1:].reshape(-1), reduction="none")
        losses.append(loss)
        loss = loss.detach().view(len(where), length - 1).numpy()
        for i, (r, o) in enumerate(where):
            out["positions"][r, o:o + length] = np.arange(length)
            out["labels"][r, o:o + length - 1] = docs[i, 1:].numpy()
            out["logits"][r, o:o + length] = logits[i].detach().numpy()
            out["nll"][r, o:o + length - 1] = loss[i]
    every = torch.cat(losses)
    mean = every.sum() / every.numel()
    mean.backward()
    out.update(loss=mean.item(), count=every.numel(),
               grads={k: p.grad.detach().clone() for k, p in model.named_parameters()})
    return out


# ----------------------------------------------------------------------------------------------
# On the ranks


def _fake_kernels():
    """ops/varlen.py's two kernel calls as their documented contract (tests/unit/test_varlen.py states it):
    per cu_seqlens sequence, softmax(q k^T * scale) v, causal bottom-right, lse [heads, tokens] fp32; the
    backward from the given out and lse."""
    from longctx.ops import varlen

    def scores(q, k, causal, scale):
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1))
        if causal:
            lq, lk = q.shape[0], k.shape[0]
            s = s.masked_fill(~(torch.arange(lk)[None] <= torch.arange(lq)[:, None] + lk - lq), float("-inf"))
        return s * scale

    def spans(cu_q, cu_k):
        a, b = cu_q.tolist(), cu_k.tolist()
        return zip(a[:-1], a[1:], b[:-1], b[1:])

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
        g = q.shape[1] // k.shape[1]
        for q0, q1, k0, k1 in spans(cu_q, cu_k):
            assert q1 - q0 <= max_q and k1 - k0 <= max_k
            s = scores(q[q0:q1], k[k0:k1], causal, scale)
            lse[:, q0:q1] = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[:, q0:q1, None])
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v[k0:k1].double().repeat_interleave(g, 1))
        return out.to(q.dtype), lse.float()

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        g = q.shape[1] // k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float64)
        dk, dv = (torch.zeros(k.shape[0], q.shape[1], q.shape[2], dtype=torch.float64) for _ in range(2))
        for q0, q1, k0, k1 in spans(cu_q, cu_k):
            ke, ve = (t[k0:k1].double().repeat_interleave(g, 1) for t in (k, v))
            p = torch.exp(scores(q[q0:q1], k[k0:k1], causal, scale) - lse[:, q0:q1, None].double())
            do = dout[q0:q1].double()
            dv[k0:k1] += torch.einsum("hqk,qhd->khd", p, do)
            delta = (do * out[q0:q1].double()).sum(-1).T[..., None]
            ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - delta)
            dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, ke) * scale
            dk[k0:k1] += torch.einsum("hqk,qhd->khd", ds, q[q0:q1].double()) * scale
        fold = lambda t: t.view(t.shape[0], k.shape[1], g, -1).sum(2).to(k.dtype)  # noqa: E731
        return dq.to(q.dtype), fold(dk), fold(dv)

    varlen.available = lambda q: True
    varlen._kernel_forward, varlen._kernel_backward = forward, backward


def layout_run(store: str, layout: dict) -> dict:
    """One layout on this rank: its share of the store's samples (read_local_batch), in `micro`
    micro-batches normalised by the step's labels; per micro-batch what it holds (global positions,
    positions, labels, logits, per-token losses); the step's loss and all-reduced gradients."""
    from longctx.data.loader import PackedSamples
    from longctx.job.dims import ParallelDims
    from longctx.job.runtime import Runtime
    from longctx.models.llama import build_model
    from longctx.parallel.context.shares import plan_share, read_local_batch
    from longctx.parallel.parallelize import use_attention_chunks, use_sequence_parallel_attention
    from longctx.step.loss import forward_loss_sum

    if layout.get("varlen"):
        _fake_kernels()
    world = torch.distributed.get_world_size()
    dims = ParallelDims(dp_shard=layout.get("dp", 1), head=layout.get("head", 1), ctx=layout.get("ctx", 1),
                        window=layout.get("window", 0), placement=layout.get("placement", "head-first"),
                        world_size=world)
    mesh = dims.build_mesh("cpu")
    world_mesh = mesh["dp_replicate", "dp_shard", "head", "ctx"]._flatten("world")
    rt = Runtime(torch.distributed.get_rank(), world, dims, mesh, world_mesh, torch.device("cpu"),
                 layout.get("balance", "docs"))
    samples = PackedSamples(store, "train", True)
    model = build_model(model_cfg(), seed=0)
    use_sequence_parallel_attention(model, dims, mesh)
    use_attention_chunks(model, layout.get("chunk", 0), False)
    micro = layout.get("micro", 1)
    per = len(samples) // micro
    draws = [list(range(k * per, (k + 1) * per)) for k in range(micro)]
    shares = [read_local_batch(rt, samples, d) for d in draws]
    valid = sum(v for _, v in shares)
    total = torch.zeros((), dtype=torch.float64)
    held = []
    for (batch, _), draw in zip(shares, draws):
        loss_sum = forward_loss_sum(model, batch, None)
        (loss_sum / valid).backward()
        total += loss_sum.detach()
        mine = draw[rt.dp_rows(len(draw))]
        _, where = plan_share(rt, samples.frames(mine).doc_ids, len(mine), samples.seq_len)
        with torch.no_grad():
            logits = model(batch.tokens, batch.positions, batch.doc_ids)
            nll = model(batch.tokens, batch.positions, batch.doc_ids, labels=batch.labels, loss_reduction="tokens")
        whole = np.broadcast_to(np.arange(samples.seq_len), (len(mine), samples.seq_len))  # (dp alone)
        at = whole if where is None else where.numpy()
        held.append({"rows": mine, "at": at, "positions": batch.positions.numpy(),
                     "labels": batch.labels.numpy(), "logits": logits.numpy(), "nll": nll[..., 0].numpy()})
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad)
    return {"loss": float(rt.sum_tensor(total)) / valid, "valid": valid, "held": held,
            # numpy, not tensors: a tensor comes back through a file descriptor of the rank, which may be gone
            "grads": {k: p.grad.numpy().copy() for k, p in model.named_parameters()} if rt.rank == 0 else None}


def train_run(store: str, run_dir: str, extra: list[str]) -> tuple:
    """train() for one step of the whole store (8 samples) with a learning rate too small to move a weight, so
    its eval after the step scores the initial weights too: (step loss, grad norm, eval loss)."""
    from longctx.config import load_config
    from longctx.train.trainer import train

    cfg = load_config(None, [
        "--model.dim=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=64",
        f"--model.vocab_size={VOCAB}", f"--data.path={store}", f"--train.seq_len={SHORT}", "--train.steps=1",
        "--train.global_batch=8", "--train.lr=1e-30", "--train.warmup_steps=0", "--train.eval_interval=1",
        "--train.eval_batches=1", "--metrics.plots=false", "--metrics.progress=false", "--checkpoint.final=false",
        f"--train.run_dir={run_dir}", *extra])
    result = train(cfg, log=lambda *a, **k: None)
    line = json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[0])
    return result.losses[0], line["grad_norm"], result.eval_losses[1]


# ----------------------------------------------------------------------------------------------
# The jobs


LAYOUTS_4 = {
    "head4": dict(head=4),
    "head4 chunk 24": dict(head=4, chunk=24),
    "ctx4 zigzag": dict(ctx=4, balance="zigzag"),
    "ctx4 docs": dict(ctx=4),
    "ctx4 window2 docs": dict(ctx=4, window=2),
    "ctx4 window2 zigzag chunk 32": dict(ctx=4, window=2, balance="zigzag", chunk=SHORT // 16),
    "head2 ctx2 docs": dict(head=2, ctx=2),
    "head2 ctx2 ctx-first zigzag": dict(head=2, ctx=2, placement="ctx-first", balance="zigzag"),
    "head2 ctx2 ctx-first docs chunk 50": dict(head=2, ctx=2, placement="ctx-first", chunk=50),
    "head2 ctx2 docs chunk 64": dict(head=2, ctx=2, chunk=SHORT // 8),
    "dp2 ctx2 docs micro 2": dict(dp=2, ctx=2, micro=2),
    "ctx4 docs varlen": dict(ctx=4, varlen=True),
    "head2 ctx2 zigzag chunk 40 varlen": dict(head=2, ctx=2, balance="zigzag", chunk=40, varlen=True),
}
LAYOUTS_2 = {  # at LONG tokens
    "head2": dict(head=2),
    "ctx2 docs": dict(ctx=2),
    "ctx2 zigzag chunk 300": dict(ctx=2, balance="zigzag", chunk=300),
    "dp2 micro 2": dict(dp=2, micro=2),
    "ctx2 docs varlen": dict(ctx=2, varlen=True),
}
TRAIN_4 = {  # train() under these flags, against the reference (one process: no flag)
    "train head2 ctx2 grad_accum 2": ["--parallel.head=2", "--parallel.ctx=2", "--train.grad_accum=2"],
    "train dp2 ctx2 grad_accum 2": ["--parallel.ctx=2", "--train.grad_accum=2"],
    "train ctx4 window2 zigzag chunked loss": ["--parallel.ctx=4", "--parallel.window=2",
                                              "--parallel.seq_balance=zigzag", "--memory.attention_chunk=48",
                                              "--memory.loss_chunk=100"],
    "train ctx4 without document masks": ["--parallel.ctx=4", "--data.doc_mask=false"],
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-docs")
    short, evals = write_store(root / "short", SHORT, edge_rows(SHORT), EVAL_ROWS)
    long_rows = [edge_rows(LONG)[i] for i in (0, 1, 3, 7)]
    long, _ = write_store(root / "long", LONG, long_rows, seed=1)
    return {"root": root, "short": (root / "short", short, edge_rows(SHORT), evals),
            "long": (root / "long", long, long_rows)}


@pytest.fixture(scope="module")
def spawned(stores):
    short, long = str(stores["short"][0]), str(stores["long"][0])
    runs = stores["root"]
    jobs4 = [(k, layout_run, (short, v)) for k, v in LAYOUTS_4.items()]
    jobs4 += [(k, train_run, (short, str(runs / k.replace(" ", "-")), v)) for k, v in TRAIN_4.items()]
    out = run_spawned_many(4, jobs4)
    out.update(run_spawned_many(2, [(k, layout_run, (long, v)) for k, v in LAYOUTS_2.items()]))
    return out


@pytest.fixture(scope="module")
def references(stores):
    _, short, rows, evals = stores["short"]
    _, long, long_rows = stores["long"]
    return {"short": reference(short, rows), "long": reference(long, long_rows),
            "eval": reference(evals, EVAL_ROWS), "short no mask": reference(short, rows, doc_mask=False),
            "eval no mask": reference(evals, EVAL_ROWS, doc_mask=False)}


def layout_errors(per_rank: list[dict], ref: dict) -> dict:
    """What every rank held against the reference: the worst errors, and what was held not exactly once."""
    seen = np.zeros(ref["labels"].shape, np.int64)
    worst = {"positions": 0, "labels": 0, "logits": 0.0, "nll": 0.0}
    for result in per_rank:
        for part in result["held"]:
            for a, r in enumerate(part["rows"]):
                at = part["at"][a]
                seen[r, at] += 1
                worst["positions"] += int((part["positions"][a] != ref["positions"][r, at]).sum())
                worst["labels"] += int((part["labels"][a] != ref["labels"][r, at]).sum())
                real = ~np.isnan(ref["logits"][r, at, 0])  # (a rank may hold nothing but padding)
                logits = np.abs(part["logits"][a][real] - ref["logits"][r, at][real]).max(initial=0)
                scored = ref["labels"][r, at] != -100
                nll = np.abs(part["nll"][a][scored] - ref["nll"][r, at][scored]).max(initial=0)
                worst["logits"], worst["nll"] = max(worst["logits"], float(logits)), max(worst["nll"], float(nll))
    grads = per_rank[0]["grads"]
    worst["grads"] = max(float((torch.from_numpy(grads[k]).double() - g).abs().max() / g.abs().max())
                         for k, g in ref["grads"].items())
    worst["loss"] = max(abs(r["loss"] - ref["loss"]) for r in per_rank)
    worst["valid"] = {r["valid"] for r in per_rank} - {ref["count"]}
    worst["not held once"] = int((seen != 1).sum())
    return worst


def _check(name, per_rank, ref):
    e = layout_errors(per_rank, ref)
    print(f"{name}: {e}")
    assert e["positions"] == e["labels"] == e["not held once"] == 0 and not e["valid"], (name, e)
    assert max(e["logits"], e["nll"], e["loss"], e["grads"]) <= TOL, (name, e)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_rank_layouts_match_each_document_alone(name, spawned, references):
    _check(name, spawned[name], references["short"])


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_rank_layouts_at_2048_tokens_match_each_document_alone(name, spawned, references):
    _check(name, spawned[name], references["long"])


@pytest.fixture(scope="module")
def one_process(stores, tmp_path_factory):
    """one_process(masked) -> train_run's figures on one process, with document masks or without: run once each
    (three of the layouts compare with the same masked run, which ran for each of them)."""
    done = {}

    def get(masked: bool) -> tuple:
        if masked not in done:
            done[masked] = train_run(str(stores["short"][0]), str(tmp_path_factory.mktemp("one")),
                                     [] if masked else ["--data.doc_mask=false"])
        return done[masked]

    return get


@pytest.mark.parametrize("name", list(TRAIN_4))
def test_the_training_loop_normalises_like_each_document_alone(name, spawned, references, one_process):
    """The step loss (mean over the step's labels across ranks and micro-batches), the gradient norm and
    the eval loss of train() on one process and under the layout, against the float64 reference."""
    masked = "without document masks" not in name
    ref, ref_eval = (references["short"], references["eval"]) if masked else \
        (references["short no mask"], references["eval no mask"])
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in ref["grads"].values())))
    for got in [one_process(masked), *spawned[name]]:
        loss, grad_norm, eval_loss = got
        assert abs(loss - ref["loss"]) <= TOL and abs(eval_loss - ref_eval["loss"]) <= TOL, (name, got, ref["loss"])
        assert abs(grad_norm - norm) <= TOL * norm, (name, grad_norm, norm)


def test_the_rows_hold_the_edges():
    """The store's rows hold what the module docstring says (so a change to edge_rows keeps the edges)."""
    for s, world in ((SHORT, 4), (LONG, 2)):
        rows = edge_rows(s)
        ends = {int(e) for r in rows for e in np.cumsum(r)}
        assert all(sum(r) <= s for r in rows) and 1 in {n for r in rows for n in r}
        assert {s // 8, s // 4, s // 2} <= ends  # zigzag chunk at ctx 4, a rank's share at 4, at 2
        assert any(sum(r) < s for r in rows) and any(r[0] >= 0.9 * s for r in rows)
        assert s // world in {n for r in rows for n in r}  # a document of exactly a rank's share
    assert len(edge_rows(LONG)[7]) > 256  # past the balance's GREEDY_DOCS_MAX: its tail fill (a LONG row)


def test_document_balance_keeps_every_token_of_skewed_rows():
    """docs_balanced_indices: each context rank holds seq / ctx distinct positions, ascending, and together
    every position once, for rows of one 50-99% document and many tiny ones (the head-tail cut, the greedy
    placement and the tail fill all at work), at ctx 2-8 and head 1-4."""
    from longctx.parallel.context.doc_balance import docs_balanced_indices

    rng = np.random.default_rng(0)
    for case in range(300):
        ctx, head = int(rng.choice([2, 3, 4, 8])), int(rng.choice([1, 2, 4]))
        unit = 2 * ctx * head
        seq = unit * int(rng.integers(1, 4096 // unit + 1))
        lengths = [int(seq * rng.uniform(0.5, 0.99))] if case % 3 else []
        while sum(lengths) < seq:
            lengths.append(min(seq - sum(lengths), int(rng.choice([1, 1, 2, 3, int(rng.integers(1, 2 + seq // 40))]))))
        if case % 2:
            rng.shuffle(lengths)
        pos = docs_balanced_indices(np.repeat(np.arange(len(lengths)), lengths), ctx, head)
        per_rank = pos.reshape(ctx, -1)
        assert pos.shape == (ctx, head, seq // (ctx * head))
        assert np.array_equal(np.sort(pos.ravel()), np.arange(seq)), (ctx, head, seq, lengths[:8])
        assert all(np.all(np.diff(r) > 0) for r in per_rank), (ctx, head, seq, lengths[:8])


def test_flat_prefill_restarts_positions_per_prompt_like_each_prompt_alone():
    """Generation's flat prefill packs prompts as training packs documents (positions restarting, attention
    per prompt): one-token and short prompts' last logits, and a decode step after it at each row's own
    position, equal the float64 reference run on each prompt alone."""
    from longctx.generate.local import prefill_flat
    from longctx.models.kv_cache import KVCache
    from longctx.models.llama import build_model

    model = build_model(model_cfg(), seed=0)
    ref = build_model(model_cfg(), seed=0).double()
    for block in ref.layers:
        block.attention.core = textbook_core
    prompts, nxt = [[5], [1, 2], [7, 8, 9], [3] * 17, [4]], [11, 12, 13, 14, 15]
    with torch.no_grad():
        cache = KVCache.for_model(model, len(prompts), 32)
        first = prefill_flat(model, cache, prompts)
        step = model(torch.tensor(nxt)[:, None], torch.tensor([len(p) for p in prompts])[:, None], cache=cache)
        for r, p in enumerate(prompts):
            alone = ref(torch.tensor([p + [nxt[r]]]))[0]
            assert (first[r].double() - alone[-2]).abs().max() <= TOL
            assert (step[r, -1].double() - alone[-1]).abs().max() <= TOL
