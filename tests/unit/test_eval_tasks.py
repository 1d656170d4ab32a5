"""Retrieval prompts, the synthetic mixture, eval sequences and per-token scores (host side)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from longctx.config.data_rules import parse_synthetic
from longctx.config.rules import parse_stages
from longctx.data.samples import IGNORE
from longctx.data.synthetic import SyntheticMixture, retrieval_prompt
from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import ConfigError, DataError
from longctx.eval.tasks import (
    TokenSource,
    load_source,
    parse_depths,
    parse_lengths,
    ppl_sequences,
    retrieval_sequences,
    store_documents,
)
from longctx.ops.loss import lm_head_token_scores

TOK = ByteTokenizer()
FILLER = np.frombuffer(("def f(x):\n    return x + 1\n" * 400).encode(), dtype=np.uint8).astype(np.int64)


@pytest.mark.parametrize("task", ["passkey", "needle"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_is_exact_length_with_the_needle_at_its_depth_and_labels_on_the_answer(task, depth):
    rng = np.random.default_rng(1)
    p = retrieval_prompt(task, FILLER, 2000, depth, rng, TOK)
    assert len(p.tokens) == 2000
    text = TOK.decode(p.tokens)
    assert text.endswith(" " + p.answer)
    assert p.answer.isdigit() and len(p.answer) == (5 if task == "passkey" else 7)
    # the answer is written in the needle, and the needle starts near `depth` of the filler
    marker = "The pass key is " if task == "passkey" else f"is: {p.answer}"
    at = text.index(marker)
    assert p.answer in text[at:at + 40]
    question_at = text.rindex("\nWhat is")
    assert abs(at / question_at - depth) < 0.1
    labels = p.labels
    scored = np.flatnonzero(labels != IGNORE)
    assert list(scored) == list(range(p.answer_start - 1, 1999))
    assert TOK.decode(labels[scored]) == " " + p.answer


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_a_stop_ends_the_answer_and_is_labelled_with_it(task):
    p = retrieval_prompt(task, FILLER, 300, 0.5, np.random.default_rng(1), TOK, stop=".")
    plain = retrieval_prompt(task, FILLER, 300, 0.5, np.random.default_rng(1), TOK)
    assert len(p.tokens) == 300 and TOK.decode(p.tokens).endswith(f" {p.answer}.")
    assert p.answer == plain.answer
    # the same question, one filler token fewer; the answer starts one token earlier
    assert TOK.decode(p.tokens[:p.answer_start]).endswith("The pass key is" if task == "passkey" else "is:")
    assert p.answer_start == plain.answer_start - 1
    scored = np.flatnonzero(p.labels != IGNORE)
    assert TOK.decode(p.labels[scored]) == f" {p.answer}."


def test_needle_hides_several_keys_and_asks_for_one():
    p = retrieval_prompt("needle", FILLER, 3000, 0.5, np.random.default_rng(3), TOK, needles=4)
    text = TOK.decode(p.tokens)
    assert text[:text.rindex("\nWhat is")].count("The special magic number for") == 4
    asked = text.split("What is the special magic number for ")[-1].split("?")[0]
    assert f"magic number for {asked} is: {p.answer}." in text


@pytest.mark.parametrize("task", ["passkey", "needle"])
@pytest.mark.parametrize("filler,boundary", [
    ("def f(x):\n    return x + 1\n", "\n"),             # code: a needle starts a line
    ("lorem ipsum dolor sit amet consectetur ", None),  # prose without newlines: a word
])
def test_needles_go_in_between_lines_or_words_never_inside_one(task, filler, boundary):
    """Spliced at the token its depth names, a needle cut a word of the filler in two ('retu The pass key
    ... rn x'): each needle now starts just after a newline (else a space) within 1/32 of the filler."""
    stream = np.frombuffer((filler * 400).encode(), dtype=np.uint8).astype(np.int64)
    for depth in (0.13, 0.31, 0.5, 0.77, 1.0):
        p = retrieval_prompt(task, stream, 3000, depth, np.random.default_rng(5), TOK)
        assert len(p.tokens) == 3000
        text = TOK.decode(p.tokens)
        text = text[:text.rindex("\nWhat is")]
        needle = "The pass key is" if task == "passkey" else "The special magic number for"
        starts = [i - 1 for i in range(len(text)) if text.startswith(" " + needle, i - 1)]
        assert len(starts) == (1 if task == "passkey" else 4)
        for at in starts:
            end = text.index("pass key. " if task == "passkey" else ". ", at + 20) + (10 if task == "passkey" else 2)
            # between two words: whitespace before the needle or after it (a line's start where the filler has lines)
            assert text[at - 1].isspace() or text[end:end + 1].isspace(), (depth, repr(text[at - 20:end + 5]))
        assert boundary is None or text[starts[0] - 1] == boundary, (depth, repr(text[starts[0] - 20:starts[0] + 20]))
        assert abs(starts[0] / len(text) - depth) < 0.1 or task == "needle"
    # a filler without a line or a word to break at keeps the depth's own token
    solid = np.full(4000, ord("x"), dtype=np.int64)
    p = retrieval_prompt("passkey", solid, 3000, 0.5, np.random.default_rng(5), TOK)
    n = 3000 - (len(p.tokens) - int((p.tokens == ord("x")).sum()))
    assert TOK.decode(p.tokens).index(" The pass key") == int(round(0.5 * n))


def test_prompt_without_room_is_refused():
    with pytest.raises(DataError, match="no room for filler"):
        retrieval_prompt("passkey", FILLER, 50, 0.5, np.random.default_rng(0), TOK)


class _Samples:
    """A stand-in store split: sample i is all tokens i % 200, documents beginning with no special tokens."""
    seq_len, doc_mask, text_prefix = 256, True, []

    def __init__(self, n):
        self.n = n
        self.real_tokens = np.full(n, 256.0)
        self.sq_tokens = np.full(n, 2 * 128.0 ** 2)

    def __len__(self):
        return self.n

    def sample(self, i):
        t = np.full(256, 40 + i % 60, dtype=np.int64)
        labels = np.append(t[1:], IGNORE)
        return t, labels, np.arange(256) % 128, np.arange(256) // 128


def test_mixture_turns_a_seeded_fraction_into_retrieval_sequences():
    mix = SyntheticMixture(_Samples(2000), "passkey", 0.25, seed=7, tokenizer=TOK)
    assert 0.2 < mix.synthetic.mean() < 0.3
    again = SyntheticMixture(_Samples(2000), "passkey", 0.25, seed=7, tokenizer=TOK)
    assert (mix.synthetic == again.synthetic).all()
    i = int(np.flatnonzero(mix.synthetic)[0])
    j = int(np.flatnonzero(~mix.synthetic)[0])
    b = mix.batch([i, j])
    assert "The pass key is" in TOK.decode(b.tokens[0].numpy())
    assert (b.doc_ids[0] == 0).all() and (b.positions[0] == torch.arange(256)).all()
    scored = (b.labels[0] != IGNORE).nonzero().flatten()
    answer = TOK.decode(b.labels[0, scored].numpy())
    assert answer.startswith(" ") and answer.endswith(".") and answer[1:-1].isdigit()  # the answer and its stop only
    assert (b.labels[0, scored] == b.tokens[0, scored + 1]).all() and scored[-1] == 254
    assert (b.tokens[1] == 40 + j % 60).all()  # the others are untouched
    assert mix.costs(1.0, 0.0)[i] == 256.0 ** 2


@pytest.mark.parametrize("spec", ["passkey", "passkey:0", "passkey:1.5", "niah:0.2", "passkey:x"])
def test_bad_mixture_spec_is_explained(spec):
    with pytest.raises(ConfigError, match="TASK:FRACTION"):
        parse_synthetic(spec)


@pytest.mark.parametrize("spec", ["1024", "1024:0", "a:3", "1024:10,", "1024:10:-1", "1:2:3:4"])
def test_bad_stages_are_explained(spec):
    with pytest.raises(ConfigError, match="SEQ_LEN:STEPS"):
        parse_stages(spec)


def test_lengths_and_depths_parse_and_refuse_bad_values():
    assert parse_lengths("1K, 4k,100") == [1024, 4096, 100]
    assert parse_depths("0,0.5,1") == [0.0, 0.5, 1.0]
    for bad in ("0", "-1K", "abc"):
        with pytest.raises(ConfigError, match="not a positive token count"):
            parse_lengths(bad)
    for bad in ("1.5", "-0.1", "x"):
        with pytest.raises(ConfigError, match=r"outside \[0, 1\]"):
            parse_depths(bad)


def test_ppl_windows_come_from_long_enough_documents():
    docs = [np.arange(10), np.arange(100, 135), np.arange(200, 220)]
    src = TokenSource(lambda: iter(docs), "test")
    seqs = ppl_sequences(src, 16, samples=5)
    assert [s.tokens[0] for s in seqs] == [100, 116, 200]
    assert (seqs[0].labels[:-1] == seqs[0].tokens[1:]).all() and seqs[0].labels[-1] == IGNORE
    with pytest.raises(DataError, match="at least 64 tokens"):
        ppl_sequences(src, 64, samples=5)


def test_a_glob_of_text_files_is_one_document_per_file_in_sorted_order(tmp_path):
    # held-out sources as eval or bench decode prompts: `--data 'DIR/**/*.py'`
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    texts = {"pkg/b.py": "print(2)\n", "pkg/a.py": "x = 1\n", "pkg/sub/c.py": "def f(): pass\n", "pkg/d.txt": "no"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    src = load_source(str(tmp_path / "pkg" / "**" / "*.py"), "eval", TOK, None)
    assert [bytes(d.astype(np.uint8)).decode() for d in src.documents()] == [texts[k] for k in
                                                                            ("pkg/a.py", "pkg/b.py", "pkg/sub/c.py")]
    assert "(3 files)" in src.description
    with pytest.raises(ConfigError, match="matches no file"):
        load_source(str(tmp_path / "none" / "*.py"), "eval", TOK, None)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        load_source(str(tmp_path / "pkg" / "*.py"), "eval", None, None)
    # a file whose name has a glob's characters is that file
    (tmp_path / "notes[1].txt").write_text("plain")
    [doc] = load_source(str(tmp_path / "notes[1].txt"), "eval", TOK, None).documents()
    assert bytes(doc.astype(np.uint8)) == b"plain"


def test_retrieval_sequences_are_deterministic_and_cover_each_depth():
    src = TokenSource(lambda: iter([FILLER]), "filler")
    a = retrieval_sequences("passkey", src, TOK, 512, [0.0, 1.0], 3, seed=0)
    b = retrieval_sequences("passkey", src, TOK, 512, [0.0, 1.0], 3, seed=0)
    assert [s.depth for s in a] == [0.0] * 3 + [1.0] * 3
    assert all((x.tokens == y.tokens).all() for x, y in zip(a, b))
    assert len({s.answer for s in a}) > 1



def test_the_prompts_at_a_depth_do_not_depend_on_the_other_depths():
    """A depth's prompts are drawn from its value, not its place in --depths: --depths 0.5 and
    --depths 0,0.5 ask the same questions at 0.5."""
    src = TokenSource(lambda: iter([FILLER]), "filler")
    alone = retrieval_sequences("passkey", src, TOK, 512, [0.5], 3, seed=0)
    among = [s for s in retrieval_sequences("passkey", src, TOK, 512, [0.0, 0.5, 1.0], 3, seed=0) if s.depth == 0.5]
    assert [s.answer for s in alone] == [s.answer for s in among]
    assert all((x.tokens == y.tokens).all() and (x.labels == y.labels).all() for x, y in zip(alone, among))
    assert [s.sample for s in among] == [0, 1, 2]


def test_a_sample_is_the_same_prompt_at_every_depth_but_for_the_needle():
    """The depth curve compares like with like: sample j asks the same key in the same filler at every
    depth (drawn from (seed, length, j)); only where the needle sits moves. Before, each depth drew its
    own key and filler, so the curve mixed position with prompt-to-prompt variance."""
    src = TokenSource(lambda: iter([FILLER]), "filler")
    seqs = retrieval_sequences("passkey", src, TOK, 512, [0.0, 0.5, 1.0], 3, seed=0)
    for j in range(3):
        at = [s for s in seqs if s.sample == j]
        assert len({s.answer for s in at}) == 1, [s.answer for s in at]
        assert len({tuple(sorted(s.tokens.tolist())) for s in at}) == 1  # the same tokens, the needle moved
        assert len({tuple(s.tokens.tolist()) for s in at}) == 3
    assert len({s.answer for s in seqs}) == 3  # the samples differ from each other

def test_store_documents_reassemble_what_was_packed(tmp_path):
    from longctx.data.builder.options import BuildOptions
    from longctx.data.builder.pipeline import build_store

    src = tmp_path / "texts"
    src.mkdir()
    texts = {f"d{i}.txt": f"doc {i} " + "word " * (30 * i + 7) for i in range(12)}
    for name, text in texts.items():
        (src / name).write_text(text)
    build_store(BuildOptions(inputs=[str(src)], out=str(tmp_path / "s"), seq_len=64, strategy="concat",
                             dedup="none", eval_fraction=0.0, stats=False, progress=False), log=lambda *_: None)
    docs = store_documents(tmp_path / "s", "train")
    got = sorted(TOK.decode(d) for d in docs)
    assert got == sorted(texts.values())


@pytest.mark.parametrize("chunk", [0, 5])
def test_token_scores_match_cross_entropy_and_argmax(chunk):
    torch.manual_seed(0)
    h, w = torch.randn(23, 8), torch.randn(30, 8)
    labels = torch.randint(0, 30, (23,))
    labels[[2, 9]] = IGNORE
    logits = h @ w.t()
    labels[4] = int(logits[4].argmax())  # at least one greedy hit
    out = lm_head_token_scores(h, w, labels, chunk=chunk)
    valid = labels != IGNORE
    ref = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    torch.testing.assert_close(out[valid, 0], ref[valid], rtol=1e-5, atol=1e-5)
    assert (out[~valid] == 0).all()
    assert (out[valid, 1].bool() == (logits.argmax(-1) == labels)[valid]).all()
    assert out[4, 1] == 1.0


def test_a_tie_is_not_a_greedy_hit():
    w = torch.randn(6, 4)
    w[3] = w[1]  # tokens 1 and 3 always tie; greedy decoding (argmax) picks 1
    h = torch.randn(5, 4) + 10 * w[1]  # so that the tied pair is the maximum
    out = lm_head_token_scores(h, w, torch.tensor([3, 3, 1, 1, IGNORE]))
    assert out[:2, 1].tolist() == [0.0, 0.0] and out[2:4, 1].tolist() == [1.0, 1.0]


def test_duplicate_lengths_and_depths_count_once():
    assert parse_lengths("1K,1024,2K") == [1024, 2048]
    assert parse_depths("0.5,0.5,1") == [0.5, 1.0]


def test_bucket_bounds_are_the_positions_each_bucket_holds():
    from types import SimpleNamespace

    from longctx.eval.score_mode import _summarise

    length, buckets = 256, 5
    counts = [0.0] * buckets
    for p in range(length):  # the runner's rule
        counts[p * buckets // length] += 1
    s = {"nll_sum": counts, "tokens": counts}
    rows = _summarise(SimpleNamespace(task="ppl"), length, [None], s, buckets, 0.0)[0]["buckets"]
    assert [r["end"] - r["start"] for r in rows] == counts
    assert rows[0]["start"] == 0 and rows[-1]["end"] == length
    assert all(a["end"] == b["start"] for a, b in zip(rows, rows[1:]))



def test_eval_asks_for_a_tokenizer_when_its_data_is_a_glob_of_text(tmp_path, monkeypatch):
    # a checkpoint that records no tokenizer: ppl on a store needs none, on text (a file or a glob) it does
    from types import SimpleNamespace

    from longctx.eval import inputs

    monkeypatch.setattr(inputs, "model_tokenizer", lambda init_from: None)
    cfg = SimpleNamespace(model=SimpleNamespace(init_from="runs/a/checkpoints", vocab_size=256))
    (tmp_path / "a.py").write_text("x = 1\n")
    store = tmp_path / "store"
    store.mkdir()
    for data, needed in ((str(tmp_path / "*.py"), True), (str(tmp_path / "a.py"), True), (str(store), False)):
        args = SimpleNamespace(tokenizer="", task="ppl", data=data, checkpoint="runs/a/checkpoints")
        if needed:
            with pytest.raises(ConfigError, match="turns text into tokens"):
                inputs._load_tokenizer(args, cfg)
        else:
            assert inputs._load_tokenizer(args, cfg) == (None, None)


@pytest.mark.parametrize("chunk", [0, 64])
def test_token_scores_put_only_the_scored_rows_through_the_head(chunk):
    """A retrieval prompt of 1,024 tokens scoring 6 answer tokens: the head's matmul covers those 6 rows (it covered
    all 1,024), with the same scores as the head over every row."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    h, w = torch.randn(1024, 16), torch.randn(300, 16)
    labels = torch.full((1024,), IGNORE)
    labels[-6:] = torch.randint(0, 300, (6,))
    with FlopCounterMode(display=False) as flops:
        out = lm_head_token_scores(h, w, labels, chunk=chunk)
    assert flops.get_total_flops() == 2 * 6 * 16 * 300
    every = F.cross_entropy(h @ w.t(), labels.clamp(min=0), reduction="none")
    torch.testing.assert_close(out[-6:, 0], every[-6:], rtol=1e-5, atol=1e-5)
    assert (out[:-6] == 0).all()
