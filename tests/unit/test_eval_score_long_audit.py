"""`longctx eval --mode score` at a few thousand tokens against a brute-force reference: transformers'
own Llama over the same hf:DIR weights in float64, one plain forward per sequence, with the per-token
NLL, the argmax verdicts and the bucketing by position written out here. Checked: ppl's bucket edges
and contents (position p, the context of the prediction of token p + 1, in bucket p * B // L; the last
position has no label and is never scored), each bucket's divisor (tokens scored), the token-weighted
mean over spans, two lengths in one run; the same figures at --batch 1 and 2 (the last batch filled with
unscored copies) with the LM head, the attention core and the blocks chunked, and on 2 ranks as dp 2,
ctx 2 and head 2; passkey's needle at its depth in the real prompt, its verdict (every answer token the
argmax: a greedy answer is a hit, one wrong token a miss) and answer NLL per depth, and the counts."""

import dataclasses
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.data.samples import IGNORE
from longctx.eval.inputs import LengthSequences
from longctx.eval.request import prepare
from longctx.eval.score_mode import evaluate_score
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TINY = ["--model.preset=debug", "--model.layers=1", "--model.dim=32", "--model.heads=4", "--model.kv_heads=2",
        "--model.ffn_dim=64"]
LENGTH, BUCKETS = 3000, 7  # (7 does not divide 3000: uneven bucket edges)
# the LM head, the attention core and the blocks' token-wise parts each run in chunks that do not divide the length
CHUNKED = ["--memory.loss_chunk=256", "--memory.attention_chunk=512", "--memory.block_chunk=768",
           "--memory.recompute=selective"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(an hf:DIR of a random one-layer dim-32 model, ~60 KB of text: one document for ppl and filler)."""
    tmp = tmp_path_factory.mktemp("long")
    cfg = load_config(overrides=TINY).model
    hf = save_hf(_sharp(build_model(cfg, seed=3)), tmp / "hf")
    root = Path(sysconfig.get_paths()["stdlib"])
    text = tmp / "long.py"
    text.write_text("".join((root / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")))
    return hf, text


def _sharp(model):
    """Weights of unit scale (init's std 0.02 gives logits within ~1e-3 of uniform): each token's NLL and each
    bucket's loss then differ by much more than the float32 error, so a token in the wrong bucket, or scored
    with the wrong context, shows."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 if "embeddings" in name else 2 / p.shape[1] ** 0.5))
    return model


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' Llama over the same weights, float64: [L] tokens -> [L, vocab] log-probabilities."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder[0], torch_dtype=torch.float64).eval()

    @torch.no_grad()
    def logprobs(tokens: np.ndarray) -> torch.Tensor:
        logits = model(torch.as_tensor(tokens, dtype=torch.long)[None]).logits[0].double()
        return torch.log_softmax(logits, dim=-1)
    return logprobs


def _args(folder, task: str, *extra):
    hf, text = folder
    more = ["--samples", "3", "--buckets", str(BUCKETS)] if task == "ppl" else ["--depths", "0,0.5,1", "--samples",
                                                                                "2"]
    return build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--data", str(text), *more,
         *extra])


def _run(folder, task: str, *extra, nproc: int = 1):
    """(the request, the result on rank 0: None on the others) of `longctx eval` run in this process."""
    args, rest = _args(folder, task, *extra)
    request = prepare(args, rest, nproc)
    return request, evaluate_score(request, args)


@pytest.mark.parametrize("extra", [[], ["--batch", "2", *CHUNKED]], ids=["batch1", "batch2-chunked"])
def test_ppl_buckets_match_a_float64_reference(folder, reference, extra):
    request, out = _run(folder, "ppl", "--lengths", str(LENGTH), *extra)
    _check_ppl(out, request.sequences[LENGTH], reference)


def test_each_length_of_one_run_is_its_own(folder, reference):
    """Two lengths in one run (the model built for the longer): each length's spans, buckets and loss are its
    own, as if it were evaluated alone."""
    request, out = _run(folder, "ppl", "--lengths", f"1000,{LENGTH}")
    assert [r["length"] for r in out["results"]] == [1000, LENGTH]
    for length in (1000, LENGTH):
        _check_ppl(out, request.sequences[length], reference, length)


def _check_ppl(out: dict, spans, reference, length: int = LENGTH) -> None:
    assert len(spans) == 3  # (at --batch 2 the second batch is one span and one unscored copy)
    nll_sum, count = np.zeros(BUCKETS), np.zeros(BUCKETS, dtype=int)
    for seq in spans:
        tokens = np.asarray(seq.tokens)
        lp = reference(tokens)
        for p in range(length - 1):  # position p predicts token p + 1; the last position predicts nothing
            b = p * BUCKETS // length
            nll_sum[b] -= lp[p, tokens[p + 1]].item()
            count[b] += 1
    (row,) = [r for r in out["results"] if r["length"] == length]
    assert row["length"] == length and row["sequences"] == 3
    assert row["tokens"] == 3 * (length - 1) == count.sum()  # tokens scored, not tokens seen
    assert row["loss"] == pytest.approx(nll_sum.sum() / count.sum(), abs=2e-5)  # token-weighted
    assert len(row["buckets"]) == BUCKETS
    for i, b in enumerate(row["buckets"]):
        held = [p for p in range(length) if p * BUCKETS // length == i]  # the positions bucket i holds
        assert (b["start"], b["end"]) == (held[0], held[-1] + 1)
        assert b["tokens"] == count[i]
        assert b["loss"] == pytest.approx(nll_sum[i] / count[i], abs=2e-5), i
    # the buckets tile [0, L) and their token-weighted mean is the length's loss
    assert row["buckets"][0]["start"] == 0 and row["buckets"][-1]["end"] == length
    assert all(a["end"] == b["start"] for a, b in zip(row["buckets"], row["buckets"][1:]))
    assert sum(b["loss"] * b["tokens"] for b in row["buckets"]) / row["tokens"] == pytest.approx(row["loss"], abs=1e-9)
    assert math.isfinite(row["loss"]) and "accuracy" not in out
    assert np.ptp(nll_sum / count) > 0.01  # (buckets that differ: a wrong bucket edge would show)


@pytest.mark.parametrize("extra", [[], ["--batch", "4", *CHUNKED]], ids=["batch1", "batch4-chunked"])
def test_passkey_by_depth_matches_a_float64_reference(folder, reference, extra):
    request, out = _run(folder, "passkey", "--lengths", "1024", *extra)
    _check_passkey(out, request.sequences[1024], reference)


def _check_passkey(out: dict, seqs, reference, length: int = 1024) -> None:
    assert len(seqs) == 6 and out["results"] and len(out["results"]) == 3
    for r, depth in zip(out["results"], (0.0, 0.5, 1.0)):
        assert r["length"] == length and r["depth"] == depth and r["samples"] == 2 == len(r["per_sample"])
        mine = [q for q in seqs if q.depth == depth]
        verdicts, nll, scored = [], 0.0, 0
        for q in mine:
            text = bytes(int(t) for t in q.tokens).decode("latin-1")  # (the byte tokenizer: ids 0..255 are bytes)
            needle = f" The pass key is {q.answer}. Remember it. {q.answer} is the pass key. "
            answer = f" {q.answer}"
            assert text.endswith("\nWhat is the pass key? The pass key is" + answer) and len(q.tokens) == length
            # the needle where the depth says, in tokens of the real prompt: depth x the filler's length, moved
            # back to the start of its line or word (at most 1/32 of the filler: data/synthetic.py _boundary)
            filler = length - len(needle) - len("\nWhat is the pass key? The pass key is") - len(answer)
            at = text.find(needle)
            assert 0 <= round(depth * filler) - at <= filler // 32, (depth, at)
            assert at == 0 or text[at - 1].isspace() or text[at + len(needle)].isspace(), (depth, at)
            # the answer's tokens: the last len(answer) of the sequence, each the label of the position before it
            lp = reference(q.tokens)
            positions = range(length - len(answer) - 1, length - 1)
            assert [int(q.labels[p]) for p in positions] == [int(q.tokens[p + 1]) for p in positions]
            assert (np.asarray(q.labels) != IGNORE).sum() == len(answer)
            verdicts.append(all(int(lp[p].argmax()) == int(q.tokens[p + 1]) for p in positions))
            nll -= sum(lp[p, q.tokens[p + 1]].item() for p in positions)
            scored += len(answer)
        assert r["per_sample"] == verdicts and r["correct"] == sum(verdicts)
        assert r["accuracy"] == sum(verdicts) / 2
        assert r["answer_nll"] == pytest.approx(nll / scored, abs=2e-5)  # per answer token, over the depth's samples
    assert out["accuracy"] == sum(r["correct"] for r in out["results"]) / 6


@pytest.mark.parametrize("batch", [1, 3])
def test_a_right_answer_is_a_hit_and_one_wrong_token_a_miss(folder, reference, batch):
    """A random model answers nothing right, so the verdicts above are all misses: here each answer is made
    the reference's own greedy continuation (a hit), every other one then with one token changed (a miss),
    scored at --batch 1 and 3 (the second batch of 3: one real sequence and two unscored copies)."""
    length, n = 512, 6  # (the answer: a space and 5 digits, 6 byte tokens)
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", "passkey", "--data", str(text),
         "--depths", "0.5", "--samples", "4", "--lengths", str(length), "--batch", str(batch)])
    request = prepare(args, rest, 1)
    made = []
    for k, q in enumerate(request.sequences[length]):
        tokens = np.array(q.tokens)
        for p in range(length - n - 1, length - 1):  # the greedy continuation, one token at a time
            tokens[p + 1] = int(reference(tokens[:p + 1])[p].argmax())
        if k % 2:
            tokens[length - 3] = (tokens[length - 3] + 1) % 256
        labels = np.full(length, IGNORE, dtype=np.int64)
        labels[length - n - 1:length - 1] = tokens[length - n:]
        made.append(dataclasses.replace(q, tokens=tokens, labels=labels))
    request.sequences = LengthSequences(lambda _: made, [length])  # (these, in place of the built ones)
    (r,) = evaluate_score(request, args)["results"]
    assert r["per_sample"] == [True, False, True, False] and r["correct"] == 2 and r["accuracy"] == 0.5


LAYOUTS = {"dp_shard": ["--parallel.dp_shard=2"], "ctx": ["--parallel.ctx=2"], "head": ["--parallel.head=2"]}


def _on_ranks(folder, task: str, extra: list[str]):
    """One `longctx eval` on this spawned rank: (its sequences, the result) on rank 0, None elsewhere."""
    request, out = _run(folder, task, *extra, nproc=2)
    # (each length's sequences built here: request.sequences builds them when asked, and is not picklable)
    return ({n: request.sequences[n] for n in request.sequences}, out) if out is not None else None


# (3 layouts x 2 tasks in one spawned job of 2 ranks: ~10 s on 2 idle cores, so not marked slow)
def test_the_figures_are_the_reference_s_under_2_rank_layouts(folder, reference):
    """dp 2 (each rank its rows; the last batch of ppl's 3 spans at --batch 2, and of passkey's 6 prompts at
    --batch 4, is half unscored copies, all on rank 1), ctx 2 (zigzag halves of every sequence) and head 2."""
    from longctx.job.spawn import run_spawned_many

    jobs = []
    for name, layout in LAYOUTS.items():
        jobs += [(f"{name}-ppl", _on_ranks, (folder, "ppl", ["--lengths", str(LENGTH), "--batch", "2", *layout])),
                 (f"{name}-passkey", _on_ranks, (folder, "passkey", ["--lengths", "1024", "--batch", "4", *layout]))]
    runs = run_spawned_many(2, jobs)
    for name in LAYOUTS:
        (seqs, out), none = runs[f"{name}-ppl"]
        assert none is None and out["layout"]["world"] == out["layout"][name] == 2
        _check_ppl(out, seqs[LENGTH], reference)
        (seqs, out), _ = runs[f"{name}-passkey"]
        _check_passkey(out, seqs[1024], reference)
