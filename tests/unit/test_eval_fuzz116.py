"""A randomized audit of evaluation's figures against an independent float64 reference: transformers' Llama and
Mixtral over the same weights (hf:DIR), one plain forward per document (tests/eval_fuzz_reference116.py). Seeded
cases over five tiny random models (tied and untied heads, GQA and MHA, 1 and 2 layers, a MoE with a capacity that
would drop tokens, one that writes digits):

- `longctx eval --mode score`, ppl (evaluate_score, its sequences replaced by random ones): random even lengths,
  one or two per run, a last --batch that is partial (filled with unscored copies), labels with random ignored holes
  or arbitrary targets, LM-head chunks (--memory.loss_chunk) that do not divide the rows, random --buckets, the
  attention core / blocks / experts chunked. Each bucket's tokens and loss and the length's (docs/eval.md: over all
  its tokens, token-weighted, not a mean of buckets or spans). And ppl's own spans of a packed store: each a piece
  of one source document, none overlapping, scored as the reference scores it.
- passkey and needle (the task's own prompts): each answer made the reference's greedy continuation (a hit) or given
  one wrong token (a miss) at random, so each (length, depth)'s verdicts and accuracy are known by construction;
  answer_nll is the mean NLL per answer token (docs/eval.md), which random labels of random counts tell from a mean
  per sample. --mode generate: each expected answer the digits the reference's greedy continuation writes first, or
  others.
- the in-training evaluation (train/evaluation.py evaluate_eval_set) over a packed store read with and without
  document masks: documents of random lengths packed by bfd (cut across samples, several per sample), random
  global batch, micro-batch and eval_batches (past the split: its last, partial global batch left out), chunked LM
  head. Its loss is the mean over every labelled token of the first eval_batches whole global batches (docs/data.md:
  per token, also under train.loss_weighting = sequence); the reference reads the store's arrays itself: with
  document masks each segment is a forward of its own whose last token predicts nothing, without them a sample's
  real tokens are one causal sequence.
- On 2 gloo ranks (ctx 2, head 2, dp 2; the in-training evaluation through Trainer under ctx 2): eight of these
  cases give the one-process figures (docs/eval.md: to 1e-5) and the reference's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from eval_fuzz_reference116 import (  # noqa: E402
    DIGITS,
    MARGIN,
    MODELS,
    Pool,
    capacity,
    make_pool,
    random_sequences,
    reference_greedy,
    reference_train_eval,
)
from longctx.cli import build_parser  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.data.loader import PackedSamples  # noqa: E402
from longctx.data.samples import IGNORE  # noqa: E402
from longctx.eval.generate_mode import evaluate_generate  # noqa: E402
from longctx.eval.inputs import LengthSequences  # noqa: E402
from longctx.eval.request import prepare  # noqa: E402
from longctx.eval.score_mode import evaluate_score  # noqa: E402
from longctx.eval.tasks import Sequence  # noqa: E402
from longctx.job.runtime import Runtime  # noqa: E402
from longctx.train import evaluation  # noqa: E402
from longctx.train.step_run import label_count  # noqa: E402

TOL = 2e-5  # float32 against float64, on means of NLLs of a few nats
LAYOUT_TOL = 1e-5  # docs/eval.md: every layout's scores are one process's to 1e-5 (float32 sums in another order)


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Pool:
    return make_pool(tmp_path_factory.mktemp("evalfuzz"))


# ---------------------------------------------------------------------------------------------------------------
# score mode: ppl


def ppl_case(seed: int, unit: int = 2, batch_unit: int = 1, model: int | None = None) -> dict:
    """Lengths a multiple of `unit` (2 x head x ctx), --batch of `batch_unit` (the data-parallel degree)."""
    rng = np.random.default_rng([116, seed])
    lengths = sorted({int(rng.integers(8 // unit, 193 // unit)) * unit for _ in range(int(rng.integers(1, 3)))})
    batch = int(rng.integers(1, 5)) * batch_unit
    chunk = int(rng.choice([0, 7, 13, 50]))  # (0: one logits tensor; else chunks that rarely divide the rows)
    # the attention core and the blocks' token-wise parts in chunks too (FPDT-style), MoE experts in pieces
    m = seed % len(MODELS) if model is None else model
    memory = [["--memory.attention_chunk=24"], ["--memory.block_chunk=30", "--memory.recompute=selective"], [],
              ["--memory.expert_chunk=17"] if capacity(m) else []][int(rng.integers(0, 4))]
    return {"model": m, "lengths": lengths, "batch": batch, "chunk": chunk,
            "buckets": int(rng.integers(1, min(9, min(lengths)) + 1)), "memory": memory,
            "seqs": {n: random_sequences(rng, n, int(rng.integers(1, 7)), 320) for n in lengths}}


def run_score(hf: Path, text: Path, task: str, lengths: list[int], seqs: dict, batch: int, chunk: int,
              extra: tuple = (), nproc: int = 1) -> dict | None:
    """`longctx eval --mode score` in this process (a spawned rank's part under nproc > 1), on `seqs` in place of
    the sequences the task builds; the result on rank 0."""
    more = ["--buckets", str(extra[0])] if task == "ppl" else ["--depths", extra[0], "--samples", str(extra[1])]
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--data", str(text),
         "--lengths", ",".join(map(str, lengths)), "--batch", str(batch), *more, f"--memory.loss_chunk={chunk}",
         *extra[2:]])
    request = prepare(args, rest, nproc)
    request.sequences = LengthSequences(lambda n: seqs[n], lengths)
    return (evaluate_generate if request.mode == "generate" else evaluate_score)(request, args)


def _run_ppl(pool: Pool, case: dict, layout: tuple = (), nproc: int = 1) -> dict | None:
    return run_score(pool.hf[case["model"]], pool.text, "ppl", case["lengths"], case["seqs"], case["batch"],
                     case["chunk"], (case["buckets"], None, *case["memory"], *capacity(case["model"]), *layout), nproc)


def check_ppl(pool: Pool, case: dict, out: dict) -> None:
    buckets = case["buckets"]
    assert [r["length"] for r in out["results"]] == case["lengths"]
    for row in out["results"]:
        length, seqs = row["length"], case["seqs"][row["length"]]
        nll, count = np.zeros(buckets), np.zeros(buckets, dtype=np.int64)
        for s in seqs:
            lp = pool.lp(case["model"], s.tokens)
            for p in np.flatnonzero(s.labels != IGNORE):  # position p, in bucket p * B // L, predicts labels[p]
                nll[p * buckets // length] -= float(lp[p, s.labels[p]])
                count[p * buckets // length] += 1
        assert row["sequences"] == len(seqs) and row["tokens"] == count.sum(), (row["tokens"], count.sum())
        assert row["loss"] == pytest.approx(nll.sum() / count.sum(), abs=TOL)
        for i, b in enumerate(row["buckets"]):
            held = [p for p in range(length) if p * buckets // length == i]
            assert (b["start"], b["end"], b["tokens"]) == (held[0], held[-1] + 1, count[i]), i
            assert b["loss"] is None if not count[i] else b["loss"] == pytest.approx(nll[i] / count[i], abs=TOL), i


PPL_CASES = range(12)


@pytest.mark.parametrize("seed", PPL_CASES)
def test_ppl_figures_match_the_reference(pool, seed):
    case = ppl_case(seed)
    check_ppl(pool, case, _run_ppl(pool, case))


@pytest.mark.parametrize("seed", range(4))
def test_ppl_over_a_packed_store_scores_aligned_spans_of_one_document(pool, seed):
    """ppl's own spans of a packed store's eval split (eval/tasks.py: its documents reassembled from the samples
    they were cut and packed into, each run of a document's text the eval split holds one): each is `length`
    consecutive tokens of one source document (docs/eval.md), scored as the reference scores it."""
    rng = np.random.default_rng([11602, seed])
    seq = int(rng.choice([40, 56]))
    case = {"model": seed % len(MODELS), "lengths": sorted({int(rng.integers(4, 33)) * 2 for _ in range(2)}),
            "batch": int(rng.integers(1, 4)), "chunk": int(rng.choice([0, 9])), "buckets": int(rng.integers(1, 5)),
            "memory": []}
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{pool.hf[case['model']]}", "--tokenizer", "byte", "--task", "ppl", "--data",
         str(pool.stores[seq]), "--lengths", ",".join(map(str, case["lengths"])), "--samples",
         str(int(rng.integers(1, 9))), "--buckets", str(case["buckets"]), "--batch", str(case["batch"]),
         f"--memory.loss_chunk={case['chunk']}", *capacity(case["model"])])
    request = prepare(args, rest, 1)
    case["seqs"] = {n: request.sequences[n] for n in case["lengths"]}
    for n, spans in case["seqs"].items():
        at = []
        for s in spans:
            homes = [(i, k) for i, d in enumerate(pool.docs[seq]) for k in range(len(d) - n + 1)
                     if np.array_equal(d[k:k + n], s.tokens)]
            assert len(homes) == 1, (n, s.tokens)  # (a piece of one source document: none read across a boundary)
            assert (s.labels[:-1] == s.tokens[1:]).all() and s.labels[-1] == IGNORE
            at.append(homes[0])
        # consecutive spans, not overlapping ones: each token of a document scored once
        assert all(a[0] != b[0] or abs(a[1] - b[1]) >= n for a, b in itertools.combinations(at, 2)), (n, at)
    check_ppl(pool, case, evaluate_score(request, args))


# ---------------------------------------------------------------------------------------------------------------
# score mode: passkey, by length and depth


def passkey_case(pool: Pool, seed: int, unit: int = 2, batch_unit: int = 1, model: int | None = None) -> dict:
    """The task's own prompts (prepare builds them; passkey, and needle every third seed), each answer made a hit
    or a miss at random, by hand."""
    rng = np.random.default_rng([1160, seed])
    m, task = seed % len(MODELS) if model is None else model, "needle" if seed % 3 == 2 else "passkey"
    low = 128 if task == "passkey" else 320  # (needle: four needles and its question take ~300 bytes)
    lengths = sorted({int(rng.integers(low // unit, 2 * low // unit + 1)) * unit
                      for _ in range(int(rng.integers(1, 3)))})
    depths = sorted({float(rng.choice([0.0, 0.1, 0.25, 0.5, 0.77, 1.0])) for _ in range(int(rng.integers(1, 4)))})
    samples = int(rng.integers(1, 4))
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{pool.hf[m]}", "--tokenizer", "byte", "--task", task, "--data",
         str(pool.text), "--lengths", ",".join(map(str, lengths)), "--depths", ",".join(map(str, depths)),
         "--samples", str(samples), "--seed", str(seed)])
    built = prepare(args, rest, 1).sequences
    seqs, hits = {}, {}
    for n in lengths:
        seqs[n] = []
        for q in built[n]:
            hit = bool(rng.random() < 0.5)
            seqs[n].append(_answered(pool, m, q, hit, rng))
            hits.setdefault((n, q.depth), []).append(hit)
    return {"task": task, "model": m, "lengths": lengths, "depths": depths, "samples": samples, "seqs": seqs,
            "hits": hits, "batch": int(rng.integers(1, 5)) * batch_unit, "chunk": int(rng.choice([0, 3, 5]))}


def _answered(pool: Pool, m: int, q: Sequence, hit: bool, rng) -> Sequence:
    """`q` with its answer the reference's greedy continuation (a hit), or that with one token not the argmax there
    (a miss). The answer's tokens are the labels of the positions before them; each stays a label."""
    at = np.flatnonzero(q.labels != IGNORE)
    digits = 5 if len(at) == 6 else 7  # (' ' and the key's digits, at the end)
    assert len(at) == digits + 1 and (at == np.arange(q.length - digits - 2, q.length - 1)).all()
    tokens = q.tokens.copy()
    for p in at:  # the greedy continuation, one token at a time, with a clear margin (else a near tie)
        lp = pool.lp(m, tokens[:p + 1])[p]
        top = torch.topk(lp, 2).values
        assert top[0] - top[1] > MARGIN, "a near tie in the reference: pick another seed"
        tokens[p + 1] = int(lp.argmax())
    if not hit:
        p = int(rng.choice(at))
        tokens[p + 1] = (tokens[p + 1] + 1 + int(rng.integers(0, 250))) % 256  # (never the argmax: it was)
    labels = np.full(q.length, IGNORE, dtype=np.int64)
    labels[at] = tokens[at + 1]
    return dataclasses.replace(q, tokens=tokens, labels=labels)


def random_retrieval_case(pool: Pool, seed: int) -> dict:
    """Retrieval scoring (--task passkey's) of random sequences: random depths, a random number of scored
    positions anywhere (not an answer's few at the end), the labels there the reference's argmax (a hit) or one of
    them not (a miss): so per-sample verdicts, and answer_nll's weighting by token, not by sample, show."""
    rng = np.random.default_rng([11601, seed])
    m, depths = seed % len(MODELS), sorted({float(rng.choice([0.0, 0.3, 1.0])) for _ in range(2)})
    lengths = sorted({int(rng.integers(64, 161)) * 2 for _ in range(int(rng.integers(1, 3)))})
    samples = int(rng.integers(1, 4))
    seqs, hits = {}, {}
    for n in lengths:
        seqs[n] = []
        for depth in depths:
            for j in range(samples):
                tokens = rng.integers(0, 256, n)
                lp = pool.lp(m, tokens)
                top = torch.topk(lp, 2).values
                clear = np.flatnonzero((top[:, 0] - top[:, 1]).numpy() > MARGIN)
                at = np.sort(rng.choice(clear, int(rng.integers(1, 12)), replace=False))
                labels = np.full(n, IGNORE, dtype=np.int64)
                labels[at] = lp[at].argmax(-1).numpy()
                hit = bool(rng.random() < 0.5)
                if not hit:
                    p = int(rng.choice(at))
                    labels[p] = (labels[p] + 1 + int(rng.integers(0, 250))) % 256
                seqs[n].append(Sequence(tokens, labels, n, depth, None, j))
                hits.setdefault((n, depth), []).append(hit)
    return {"task": "passkey", "model": m, "lengths": lengths, "depths": depths, "samples": samples, "seqs": seqs,
            "hits": hits, "batch": int(rng.integers(1, 5)), "chunk": int(rng.choice([0, 2, 5]))}


def check_passkey(pool: Pool, case: dict, out: dict) -> None:
    rows = out["results"]
    assert [(r["length"], r["depth"]) for r in rows] == [(n, d) for n in case["lengths"] for d in case["depths"]]
    for r in rows:
        mine = [q for q in case["seqs"][r["length"]] if q.depth == r["depth"]]
        hits = case["hits"][(r["length"], r["depth"])]
        assert r["per_sample"] == hits and r["samples"] == len(hits) == case["samples"]
        assert r["correct"] == sum(hits) and r["accuracy"] == sum(hits) / len(hits)
        nll = sum(-float(pool.lp(case["model"], q.tokens)[p, q.labels[p]])
                  for q in mine for p in np.flatnonzero(q.labels != IGNORE))
        scored = sum(int((q.labels != IGNORE).sum()) for q in mine)
        assert r["answer_nll"] == pytest.approx(nll / scored, abs=TOL)  # per answer token (docs/eval.md)
    every = [h for hits in case["hits"].values() for h in hits]
    assert out["accuracy"] == sum(every) / len(every)


def _run_passkey(pool: Pool, case: dict, layout: tuple = (), nproc: int = 1) -> dict | None:
    return run_score(pool.hf[case["model"]], pool.text, case["task"], case["lengths"], case["seqs"], case["batch"],
                     case["chunk"], (",".join(map(str, case["depths"])), case["samples"], *capacity(case["model"]),
                                     *layout), nproc)


@pytest.mark.parametrize("seed", range(6))
def test_passkey_verdicts_by_length_and_depth_are_the_hand_count(pool, seed):
    case = passkey_case(pool, seed)
    check_passkey(pool, case, _run_passkey(pool, case))


@pytest.mark.parametrize("seed", range(3))
def test_retrieval_scoring_of_random_labels_is_the_hand_count(pool, seed):
    case = random_retrieval_case(pool, seed)
    check_passkey(pool, case, _run_passkey(pool, case))


# ---------------------------------------------------------------------------------------------------------------
# generate mode: passkey / needle answered by free greedy generation


def generate_case(pool: Pool, seed: int) -> dict:
    """A passkey_case's prompts, each sample's expected answer set to the digits the reference's greedy
    continuation writes first (a hit) or to other digits (a miss), at random; by construction."""
    import re

    case = passkey_case(pool, 20 + seed, model=DIGITS if seed % 2 == 0 else None)
    rng = np.random.default_rng([11603, seed])
    hits, unsure = {}, {}
    for n, seqs in case["seqs"].items():
        for i, q in enumerate(seqs):
            at = int(np.flatnonzero(q.labels != IGNORE)[0]) + 1  # (the answer's first token: the prompt ends before)
            text = reference_greedy(pool, case["model"], q.tokens[:at], n - at + 8)  # (answer + 8 new tokens)
            first = re.search("[0-9]+", text or "")
            hit = bool(first) and bool(rng.random() < 0.7)
            answer = first.group() if hit else str(int(first.group() if first else "0") + 1 + int(rng.integers(9)))
            seqs[i] = dataclasses.replace(q, answer=answer)
            hits.setdefault((n, q.depth), []).append(hit)
            unsure.setdefault((n, q.depth), []).append(text is None)
    return {**case, "hits": hits, "unsure": unsure}


def _run_generate(pool: Pool, case: dict, layout: tuple = (), nproc: int = 1) -> dict | None:
    return run_score(pool.hf[case["model"]], pool.text, case["task"], case["lengths"], case["seqs"], case["batch"],
                     0, (",".join(map(str, case["depths"])), case["samples"], "--mode", "generate",
                         *capacity(case["model"]), *layout), nproc)


def check_generate(case: dict, out: dict) -> None:
    rows = out["results"]
    assert [(r["length"], r["depth"]) for r in rows] == [(n, d) for n in case["lengths"] for d in case["depths"]]
    for r in rows:
        key = (r["length"], r["depth"])
        assert r["answers"] == [q.answer for q in case["seqs"][r["length"]] if q.depth == r["depth"]]
        sure = [i for i, u in enumerate(case["unsure"][key]) if not u]
        assert [r["per_sample"][i] for i in sure] == [case["hits"][key][i] for i in sure], key
        assert r["correct"] == sum(r["per_sample"]) and r["accuracy"] == r["correct"] / r["samples"]
    assert out["accuracy"] == sum(r["correct"] for r in rows) / sum(r["samples"] for r in rows)


@pytest.mark.parametrize("seed", range(4))
def test_generate_mode_verdicts_are_the_reference_greedy_s(pool, seed):
    case = generate_case(pool, seed)
    check_generate(case, _run_generate(pool, case))


# ---------------------------------------------------------------------------------------------------------------
# the in-training evaluation over a packed store, with and without document masks


def train_case(seed: int) -> dict:
    rng = np.random.default_rng([11600, seed])
    global_batch = int(rng.integers(1, 5))
    return {"model": seed % len(MODELS), "seq_len": int(rng.choice([40, 56])), "doc_mask": bool(seed % 2),
            "global_batch": global_batch, "micro": int(rng.choice([d for d in range(1, 5) if global_batch % d == 0])),
            "eval_batches": int(rng.choice([1, 2, 5, 50])), "chunk": int(rng.choice([0, 6, 11, 100]))}


def run_train_eval(pool: Pool, case: dict) -> float:
    """train/evaluation.py evaluate_eval_set's loss, for a trainer holding this model and the store's eval split."""
    cfg = load_config(None, [f"--train.eval_batches={case['eval_batches']}", "--train.device=cpu"])
    model = pool.ours[case["model"]]
    model.loss_chunk = case["chunk"]
    trainer = SimpleNamespace(model=model, cfg=cfg, rt=Runtime.create(cfg, 0, 1, "cpu"), device=torch.device("cpu"),
                              eval_samples=PackedSamples(pool.stores[case["seq_len"]], "eval", case["doc_mask"]),
                              micro_step_sequences=case["micro"], autocast_dtype=None,
                              sampler=SimpleNamespace(stage=SimpleNamespace(global_batch=case["global_batch"])))
    try:
        return evaluation.evaluate_eval_set(trainer, functools.partial(label_count, trainer)).loss
    finally:
        model.loss_chunk = 0


@pytest.mark.parametrize("seed", range(12))
def test_in_training_eval_over_packed_documents_matches_the_reference(pool, seed):
    case = train_case(seed)
    loss, count, n = reference_train_eval(pool, case)
    assert n > 0 and count > 0
    assert run_train_eval(pool, case) == pytest.approx(loss, abs=TOL), (case, count, n)


# ---------------------------------------------------------------------------------------------------------------
# 2 gloo ranks: the one-process figures


def trainer_eval(pool: Pool, case: dict, run_dir: str, layout: tuple = ()) -> float:
    """Trainer.evaluate's loss (train/trainer.py, as a run's periodic evaluation gives it) of the hf:DIR weights."""
    from longctx.train.trainer import Trainer

    hf, store = pool.hf[case["model"]], pool.stores[case["seq_len"]]
    cfg = load_config(None, [f"--model.init_from=hf:{hf}", "--data.tokenizer=byte", f"--data.path={store}",
                             f"--train.seq_len={case['seq_len']}", f"--train.global_batch={case['global_batch']}",
                             f"--train.grad_accum={case['global_batch'] // case['micro']}",
                             f"--train.eval_batches={case['eval_batches']}", f"--data.doc_mask={case['doc_mask']}",
                             f"--memory.loss_chunk={case['chunk']}", "--train.device=cpu", "--metrics.plots=false",
                             "--metrics.progress=false", f"--train.run_dir={run_dir}", *capacity(case["model"]),
                             *layout])
    return Trainer(cfg, log=lambda *a, **k: None).evaluate()


RUNS = {"ppl": _run_ppl, "passkey": _run_passkey, "generate": _run_generate}


def _ranked(kind: str, pool: Pool, case: dict, layout: tuple, run_dir: str):
    """One spawned rank's part of a case (the figures on rank 0, None on the other)."""
    if kind == "train":
        return trainer_eval(pool, case, run_dir, layout)
    return RUNS[kind](pool, case, layout, nproc=2)


def _ranked_cases(pool: Pool) -> dict:
    """name -> (kind, case, layout): each a case of the fuzz above, drawn for the layout (lengths of 2 x ctx x head,
    batches of the data-parallel degree; the last batch still partial where the draw says)."""
    ctx, head, dp = ("--parallel.ctx=2",), ("--parallel.head=2",), ("--parallel.dp_shard=2",)
    return {"ppl-ctx2-moe": ("ppl", ppl_case(3, unit=4, model=3), ctx),
            "ppl-head2": ("ppl", ppl_case(6, unit=4, model=0), head),
            "ppl-dp2": ("ppl", ppl_case(4, batch_unit=2, model=1), dp),
            "needle-ctx2": ("passkey", passkey_case(pool, 2, unit=4, model=2), ctx),
            "passkey-dp2-moe": ("passkey", passkey_case(pool, 1, batch_unit=2, model=3), dp),
            "generate-ctx2": ("generate", generate_case(pool, 0), ctx),  # (the KV cache sharded over 2 ranks)
            # (a MoE scored dropless; training's loss per sequence, which evaluation leaves per token: docs/data.md)
            "train-ctx2-docs-moe": ("train", {**train_case(7), "doc_mask": True, "model": 3},
                                    (*ctx, "--train.loss_weighting=sequence")),
            "train-ctx2-plain": ("train", {**train_case(0), "doc_mask": False}, ctx)}


# (not slow: ~15 s on 2 idle cores, eight cases in one spawned job of 2 ranks and their one-process runs)
def test_two_ranks_give_the_one_process_figures(pool, tmp_path):
    from longctx.job.spawn import run_spawned_many

    cases = _ranked_cases(pool)
    paths = dataclasses.replace(pool, ours=[], refs=[], seen={})  # (what a rank reads: the hf:DIRs, text and stores)
    runs = run_spawned_many(2, [(name, _ranked, (kind, paths, case, layout, str(tmp_path / name)))
                                for name, (kind, case, layout) in cases.items()])
    for name, (kind, case, _) in cases.items():
        out, none = runs[name]
        assert none is None or kind == "train", name
        if kind == "train":
            alone = trainer_eval(pool, case, str(tmp_path / f"one-{name}"))
            assert out == none and abs(out - alone) <= LAYOUT_TOL, (name, out, alone)
            assert alone == pytest.approx(reference_train_eval(pool, case)[0], abs=TOL), name
            continue
        alone = RUNS[kind](pool, case)
        assert out["layout"]["world"] == 2, name
        assert _rows(out) == _rows(alone), name  # (tokens, verdicts, bucket edges, generated text: exactly)
        for theirs, mine in zip(_figures(out), _figures(alone), strict=True):
            assert theirs == pytest.approx(mine, abs=LAYOUT_TOL), name
        if kind == "generate":
            check_generate(case, out)
        else:
            (check_ppl if kind == "ppl" else check_passkey)(pool, case, out)


def _figures(out: dict) -> list:
    """A result's losses (None for a bucket that scored nothing) in order."""
    return [f for r in out["results"] for f in [r.get("loss"), r.get("answer_nll"),
                                                 *(b["loss"] for b in r.get("buckets", []))] if f is not None]


def _rows(out: dict) -> list[dict]:
    """A result's rows without the figures _figures compares and the seconds."""
    drop = ("loss", "answer_nll", "seconds")
    return [{k: [{**b, "loss": b["loss"] is None} for b in v] if k == "buckets" else v
             for k, v in r.items() if k not in drop} for r in out["results"]]
