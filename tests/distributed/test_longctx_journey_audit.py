"""A long-context user's data-to-training journey, checked at its seams against plain-Python references.

1. A corpus of three .jsonl files (long documents of ~10 samples, short ones, exact duplicates up to line-end
   whitespace, near duplicates of long documents with one word changed, empty and whitespace-only records) is
   built by `train.stages` into one store per stage length (data.corpus, DataSculpt packing, MinHash dedup, two
   scan workers, a shard per file, a held-out eval split). Reference: the planted corpus itself (which records
   are kept, in input order, as the byte tokenizer's bytes + EOS), not the builder's dedup; both stages hold out
   the same text.
2. Training on the stores with document masks, `train.stages = "128:3,256:3"`, grad_accum 2, selective recompute
   and a chunked loss, on one process and under ctx 2: step losses agree (1e-4, the parity tests' tolerance),
   each step's label count equals the count of the drawn samples' segments (length - 1 each: a document's last
   token predicts nothing, padding nothing), step 1's loss equals a float64 model run on each document alone
   (tests/distributed/test_packed_docs_edges_audit.py's reference), and the documents / train tokens training
   announces equal the reference's. The metrics' `tokens` are positions (seq_len x global batch per step, as
   throughput counts them), padding included: 4,608 here for 4,000 documents' tokens.
3. Resumed from the step-2 checkpoint (inside stage 1) under ctx 2, and from step 3 (stage 1's last) and step 4
   (inside stage 2) under head 2 x ctx 2: the resumed steps draw the same samples of the same stores (token ids
   read from the store files), cross the boundary at step 4, read the same shares as the uninterrupted run of
   their layout, and train to the same losses.
4. A global batch per stage (`"128:3:8,256:3:4"`) under dp 2 x ctx 2: each micro-batch holds the samples one
   process draws, the same label counts and losses, and the metrics' tokens follow the stages' batches.

Found by this audit: with `--max-docs` (data.max_docs), the manifest counted the empty records and files that
shards had scanned past the limit (each shard reads up to --max-docs documents of its own, and workers scan a
round of shards at once): test_max_docs_counts_only_what_lies_before_its_last_document.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from longctx.job.spawn import run_spawned_many

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "unit"))
sys.path.insert(0, str(TESTS / "distributed"))
from test_data_build import store_documents, text_doc  # noqa: E402
from test_packed_docs_edges_audit import VOCAB, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STAGES = [(128, 3), (256, 3)]
STAGE_BATCHES = "128:3:8,256:3:4"  # a global batch per stage
TOL = 1e-4  # fp32 layouts against one process (tests/distributed/test_training_parity.py)
MODEL = ["--model.dim=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2", "--model.ffn_dim=64",
         f"--model.vocab_size={VOCAB}"]


def planted_corpus(d: Path) -> tuple[list[str], list[str]]:
    """Three .jsonl files of 72 records in input order; (every record's text, the texts a build keeps: not
    empty, not an exact duplicate up to whitespace at line ends, not a near duplicate of an earlier one)."""
    rng = random.Random(5)
    texts, kept, longs = [], [], []
    for i in range(72):
        kind = i % 9
        if kind in (0, 5):
            t = text_doc(rng, rng.randint(150, 260))  # 1-2.5K bytes: ~10 samples of 128
            longs.append(t)
        elif kind == 3 and len(kept) > 2:
            t = kept[-2].replace("\n", "  \n")  # an exact duplicate up to trailing whitespace
        elif kind == 6:
            t = rng.choice(["", "   ", "\n\n \t\n"])
        elif kind == 8 and longs:
            words = longs[-1].split(" ")
            words[len(words) // 2] += "q"  # one word of 150+: shingle Jaccard ~0.95 > 0.8
            t = " ".join(words)
        else:
            t = text_doc(rng, rng.randint(1, 30))
        texts.append(t)
        if kind not in (3, 6, 8) or (kind == 3 and len(kept) <= 2) or (kind == 8 and not longs):
            kept.append(t)
    d.mkdir(parents=True)
    for k in range(3):  # contiguous thirds, so the input order is the files' order
        (d / f"part{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[24 * k:24 * (k + 1)]))
    return texts, kept


def base_args(corpus: str, run_dir: str, stages: str = ",".join(f"{s}:{n}" for s, n in STAGES)) -> list[str]:
    return [*MODEL, f"--data.corpus={corpus}", "--data.strategy=datasculpt", "--data.dedup=minhash",
            "--data.workers=2", "--data.eval_fraction=0.2", "--data.tokenizer=byte",
            f"--train.stages={stages}", "--train.steps=6",
            "--train.global_batch=4", "--train.grad_accum=2", "--train.lr=3e-3", "--train.warmup_steps=1",
            "--train.eval_interval=0", "--memory.recompute=selective", "--memory.loss_chunk=48",
            "--metrics.plots=false", "--metrics.progress=false", "--metrics.log_interval=1",
            "--checkpoint.interval=1", "--checkpoint.keep=6", f"--train.run_dir={run_dir}"]


def recorded_train(args: list[str]) -> dict:
    """train() with what each step read recorded: per step its stage, store, drawn sample indices, label count
    and this rank's share of tokens; the losses, the metrics lines and the log."""
    from longctx.config import load_config
    from longctx.train import stages
    from longctx.train.trainer import train

    made, steps, log = {}, [], []
    read, step_batches = stages.StagedLoader._read, stages.StagedLoader.step_batches

    def rec_read(self, samples, draws):
        out = read(self, samples, draws)
        made[id(out)] = (str(samples.root), [list(map(int, d)) for d in draws])
        return out

    def rec_step_batches(self, step):
        out = step_batches(self, step)
        root, draws = made.pop(id(out))
        steps.append({"step": step, "stage": self.stage.index, "root": root, "draws": draws,
                      "valid": sum(int(v) for _, v in out), "shares": [b.tokens.tolist() for b, _ in out]})
        return out

    stages.StagedLoader._read, stages.StagedLoader.step_batches = rec_read, rec_step_batches
    try:
        cfg = load_config(None, args)
        result = train(cfg, log=lambda *a, **k: log.append(" ".join(map(str, a))))
    finally:
        stages.StagedLoader._read, stages.StagedLoader.step_batches = read, step_batches
    path = Path(cfg.train.run_dir) / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return {"losses": list(result.losses), "steps": steps, "log": log, "metrics": lines}


def store_rows(root: str, indices: list[int]) -> tuple[np.ndarray, list[list[int]]]:
    """Train samples `indices` of a store read from its files: token rows and segment lengths per row."""
    m = json.loads((Path(root) / "manifest.json").read_text())
    rows, lengths, offset = {}, {}, 0
    for part in m["parts"]:
        n = part["splits"]["train"]["samples"]
        if not n:
            continue
        d = Path(root) / part["dir"]
        toks, segs = np.load(d / "train.tokens.npy"), np.load(d / "train.segments.npy")
        for i in indices:
            if offset <= i < offset + n:
                rows[i] = toks[i - offset].astype(np.int64)
                lengths[i] = [int(s[2]) for s in segs if s[0] == i - offset]
        offset += n
    return np.stack([rows[i] for i in indices]), [lengths[i] for i in indices]


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    base = tmp_path_factory.mktemp("lcjourney")
    texts, kept = planted_corpus(base / "corpus")
    from longctx.data.builder import scan

    shard_bytes, scan.SHARD_BYTES = scan.SHARD_BYTES, 4096  # several shards (the cache key does not hold it)
    try:
        one = recorded_train(base_args(str(base / "corpus"), str(base / "one")))
        batches = recorded_train(base_args(str(base / "corpus"), str(base / "batches"), STAGE_BATCHES))
    finally:
        scan.SHARD_BYTES = shard_bytes
    corpus = str(base / "corpus")
    jobs2 = [("ctx2", recorded_train, ([*base_args(corpus, str(base / "ctx2")), "--parallel.ctx=2"],)),
             ("ctx2 resumed at 2", recorded_train,
              ([*base_args(corpus, str(base / "one")), "--parallel.ctx=2",
                f"--checkpoint.resume={base}/one/checkpoints/step-00000002", f"--checkpoint.dir={base}/one/b"],))]
    runs = run_spawned_many(2, jobs2)
    jobs4 = [(f"head2 ctx2 resumed at {at}", recorded_train,
              ([*base_args(corpus, str(base / whole)), "--parallel.head=2", "--parallel.ctx=2",
                f"--checkpoint.resume={base}/{whole}/checkpoints/step-{at:08d}",
                f"--checkpoint.dir={base}/{whole}/{at}"],))
             for whole, at in (("ctx2", 4), ("one", 3))]
    jobs4.append(("dp2 ctx2 stage batches", recorded_train,
                  ([*base_args(corpus, str(base / "dp2"), STAGE_BATCHES), "--parallel.ctx=2"],)))
    runs.update(run_spawned_many(4, jobs4))
    return {"texts": texts, "kept": kept, "one": one, "batches": batches, **{k: v[0] for k, v in runs.items()},
            "ranks": runs}


def test_each_stage_store_holds_the_kept_documents_once_in_order(journey):
    from longctx.data.tokenizer import ByteTokenizer

    texts, kept = journey["texts"], journey["kept"]
    assert len(kept) < len(texts) - 8  # the corpus plants empties and both kinds of duplicate
    tok = ByteTokenizer()
    want = [tok.encode(t).tolist() + [tok.eos_id] for t in kept]
    roots = {s["stage"]: s["root"] for s in journey["one"]["steps"]}
    assert sorted(roots) == [0, 1]
    evals = {}
    for stage, root in roots.items():
        m = json.loads((Path(root) / "manifest.json").read_text())
        assert m["seq_len"] == STAGES[stage][0] and m["strategy"] == "datasculpt" and m["dedup"] == "minhash"
        docs = store_documents(Path(root))
        assert [docs[i] for i in range(len(want))] == want and len(docs) == len(want)
        counts = m["parts"][0]["counts"]
        assert m["parts"][0]["stages"]["scan"]["shards"] == 3  # a shard per file, scanned by two workers
        empties = sum(not t.strip() for t in texts)
        assert counts["skipped"] == {"empty": empties}
        assert m["totals"]["documents"] == len(kept)
        assert m["totals"]["duplicates_removed"] == len(texts) - empties - len(kept)
        assert m["totals"]["tokens"] == sum(map(len, want))
        evals[stage] = _eval_text(Path(root))
    # both stages hold out the same text (the longest stage's grid): no stage trains on another's eval text
    assert evals[0] == evals[1] and evals[0]


def _eval_text(root: Path) -> dict:
    """{doc: sorted (start, length) of its eval pieces}."""
    part = root / "part-00000"
    if not (part / "eval.segments.npy").is_file():
        return {}
    out: dict = {}
    for _, _, n, doc, start in np.load(part / "eval.segments.npy").tolist():
        out.setdefault(doc, []).append((start, n))
    merged = {}
    for doc, pieces in out.items():  # consecutive pieces as one run (samples cut them at their own lengths)
        runs = []
        for start, n in sorted(pieces):
            if runs and runs[-1][1] == start:
                runs[-1][1] = start + n
            else:
                runs.append([start, start + n])
        merged[doc] = runs
    return merged


def test_step_losses_under_ctx2_equal_one_process(journey):
    one, ctx2 = journey["one"]["losses"], journey["ctx2"]["losses"]
    assert len(one) == len(ctx2) == 6
    diff = max(abs(a - b) for a, b in zip(one, ctx2))
    assert diff <= TOL, (one, ctx2)


def test_each_step_reads_its_stage_and_counts_the_labels_of_its_segments(journey):
    for name in ("one", "ctx2"):
        steps = journey[name]["steps"]
        assert [s["step"] for s in steps] == list(range(1, 7))
        assert [s["stage"] for s in steps] == [0, 0, 0, 1, 1, 1]
        for s in steps:
            assert [len(d) for d in s["draws"]] == [2, 2]  # global_batch 4 / grad_accum 2
            _, lengths = store_rows(s["root"], [i for d in s["draws"] for i in d])
            assert s["valid"] == sum(max(n - 1, 0) for row in lengths for n in row), (name, s["step"])
    assert journey["one"]["steps"][0]["draws"] == journey["ctx2"]["steps"][0]["draws"]


def test_the_first_step_loss_is_each_document_alone(journey):
    """Step 1 (initial weights) against a float64 model run on each segment alone: the loss is over the
    right tokens (none across documents, none at padding) and normalised by their count across the two
    micro-batches and the ctx ranks."""
    s = journey["one"]["steps"][0]
    tokens, lengths = store_rows(s["root"], [i for d in s["draws"] for i in d])
    ref = reference(tokens, lengths)
    assert ref["count"] == s["valid"]
    for name in ("one", "ctx2"):
        assert abs(journey[name]["losses"][0] - ref["loss"]) <= 2e-5, (name, journey[name]["losses"][0], ref["loss"])


def test_metrics_and_log_report_what_was_trained(journey):
    one = journey["one"]
    assert [line["step"] for line in one["metrics"]] == list(range(1, 7))
    for line in one["metrics"]:  # positions trained so far (padding included: see the module docstring)
        step = line["step"]
        assert line["seq_len"] == (128 if step <= 3 else 256)
        assert line["tokens"] == 4 * (128 * min(step, 3) + 256 * max(0, step - 3)), line
    real = sum(sum(map(sum, store_rows(s["root"], [i for d in s["draws"] for i in d])[1])) for s in one["steps"])
    print(f"metrics tokens {one['metrics'][-1]['tokens']:,}; documents' tokens in the steps' samples {real:,}")
    for root in {s["root"] for s in one["steps"]}:
        m = json.loads((Path(root) / "manifest.json").read_text())
        segs = np.load(Path(root) / "part-00000" / "train.segments.npy")
        said = [x for x in one["log"] if x.startswith(f"data: {root} ->")]
        assert len(said) == 1, one["log"]
        assert f" -> {len(journey['kept']):,} documents" in said[0]
        assert f"{int(segs[:, 2].sum()):,} train tokens in {m['totals']['train_samples']:,} samples" in said[0]


RESUMES = [("ctx2 resumed at 2", "one", 3), ("head2 ctx2 resumed at 3", "one", 4),
           ("head2 ctx2 resumed at 4", "ctx2", 5)]


@pytest.mark.parametrize("name,whole,first", RESUMES)
def test_a_resume_reads_the_batches_of_the_uninterrupted_run(journey, name, whole, first):
    """From a checkpoint inside stage 1 (step 2), at its last step (3) and inside stage 2 (step 4), under
    another layout: the same stores, samples, token ids and label counts step by step, the boundary at step 4
    (stage 2 from its first sample), the same losses."""
    resumed, full = journey[name], journey[whole]
    got = resumed["steps"]
    assert [s["step"] for s in got] == list(range(first, 7))
    assert [s["stage"] for s in got] == [0 if k <= 3 else 1 for k in range(first, 7)]  # the boundary at step 4
    for s in got:
        ref = full["steps"][s["step"] - 1]
        assert (s["root"], s["draws"], s["valid"]) == (ref["root"], ref["draws"], ref["valid"]), (name, s["step"])
        flat = [i for d in s["draws"] for i in d]
        assert np.array_equal(store_rows(s["root"], flat)[0], store_rows(ref["root"], flat)[0])
    if name.startswith("ctx2"):  # the same layout as the ctx 2 run: each rank's shares, token by token
        for rank_full, rank_resumed in zip(journey["ranks"]["ctx2"], journey["ranks"][name]):
            for s in rank_resumed["steps"]:
                assert s["shares"] == rank_full["steps"][s["step"] - 1]["shares"], (name, s["step"])
    losses = resumed["losses"]
    assert len(losses) == 7 - first
    diff = max(abs(a - b) for a, b in zip(losses, full["losses"][first - 1:]))
    assert diff <= TOL, (name, losses, full["losses"])


@pytest.mark.parametrize("max_docs,workers", [(30, 1), (21, 2)])
def test_max_docs_counts_only_what_lies_before_its_last_document(tmp_path, monkeypatch, max_docs, workers):
    """`data.max_docs` / `--max-docs` with several shards: the manifest counts the empty records and the files of
    the input before the limit's last document, as a scan that stopped there would. Found by this audit: each
    shard scans up to --max-docs documents of its own (and workers scan a round of shards at once), and their
    skips and files past the limit were counted too (30 docs: 5 empty records for 3; 21 docs on 2 workers: 2
    files and 5 empty for 1 and 2)."""
    from longctx.data.builder import scan
    from longctx.data.builder.options import BuildOptions
    from longctx.data.builder.pipeline import build_store
    from longctx.data.tokenizer import ByteTokenizer

    monkeypatch.setattr(scan, "SHARD_BYTES", 4096)  # a shard per file
    texts, kept = planted_corpus(tmp_path / "in")
    m = build_store(BuildOptions(inputs=[str(tmp_path / "in")], out=str(tmp_path / "s"), seq_len=128, workers=workers,
                                 max_docs=max_docs, strategy="bfd", dedup="minhash", progress=False),
                    log=lambda *a: None)
    last = [i for i, t in enumerate(texts) if t.strip()][max_docs - 1]  # the record of the limit's last document
    counts = m["parts"][0]["counts"]
    assert counts["documents_read"] == max_docs
    assert counts["skipped"] == {"empty": sum(not t.strip() for t in texts[:last + 1])}
    assert counts["files"] == last // 24 + 1 and m["totals"]["files_skipped"] == counts["skipped"]["empty"]
    tok = ByteTokenizer()
    docs = store_documents(tmp_path / "s")
    want = [tok.encode(t).tolist() + [tok.eos_id] for t in kept if texts.index(t) <= last]
    assert [docs[i] for i in range(len(docs))] == want


def test_stage_batches_under_dp2_ctx2_draw_and_train_like_one_process(journey):
    """A global batch per stage (8, then 4) under dp 2 x ctx 2 with grad_accum 2: each micro-batch holds the
    samples one process draws (in the cost-balanced order dp hands out), the label counts of their segments, the
    tokens the metrics report follow the stages' batches, and the losses are one process's."""
    one, dp2 = journey["batches"], journey["dp2 ctx2 stage batches"]
    assert [[len(d) for d in s["draws"]] for s in one["steps"]] == [[4, 4]] * 3 + [[2, 2]] * 3
    for a, b in zip(one["steps"], dp2["steps"]):
        assert [sorted(d) for d in a["draws"]] == [sorted(d) for d in b["draws"]] and a["root"] == b["root"]
        _, lengths = store_rows(a["root"], [i for d in a["draws"] for i in d])
        assert a["valid"] == b["valid"] == sum(max(n - 1, 0) for row in lengths for n in row)
    assert [line["tokens"] for line in dp2["metrics"]] == [128 * 8 * k for k in (1, 2, 3)] + \
        [128 * 8 * 3 + 256 * 4 * k for k in (1, 2, 3)]
    diff = max(abs(a - b) for a, b in zip(one["losses"], dp2["losses"]))
    assert len(dp2["losses"]) == 6 and diff <= TOL, (one["losses"], dp2["losses"])


@pytest.mark.parametrize("max_docs", [15, 20])
def test_max_docs_names_only_the_damaged_files_before_its_last_document(tmp_path, monkeypatch, max_docs):
    """A corrupt .gz after the limit's last document is a file a scan that stopped there never opens: not in
    damaged_files (the review of the cut above: its counts said "nothing skipped" while damaged_files named it);
    one before it is named, and its documents are not kept."""
    import gzip

    from longctx.data.builder import scan
    from longctx.data.builder.options import BuildOptions
    from longctx.data.builder.pipeline import build_store

    monkeypatch.setattr(scan, "SHARD_BYTES", 1024)  # a shard per file
    d = tmp_path / "in"
    d.mkdir()
    rng = random.Random(3)
    for name in ("a", "c"):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"text": text_doc(rng, 30)}) + "\n" for _ in range(15)))
    (d / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "lost"}\n' * 50)[:-12])  # its checksum cut off
    m = build_store(BuildOptions(inputs=[str(d)], out=str(tmp_path / "s"), seq_len=128, workers=2, max_docs=max_docs,
                                 strategy="bfd", dedup="none", progress=False), log=lambda *a: None)
    counts = m["parts"][0]["counts"]
    assert counts["documents_read"] == max_docs
    if max_docs == 15:  # a.jsonl's 15 documents: b and c are past the limit
        assert counts["damaged_files"] == [] and counts["skipped"] == {} and counts["files"] == 1
    else:
        assert [Path(f).name for f in counts["damaged_files"]] == ["b.jsonl.gz"] and counts["files"] == 3
