"""Dedup of instruction data (data/builder/dedup.py): a pair is a copy only of a pair whose prompt and answers
are both copies of its own. Many questions on one long document share a prompt that a signature of the
whole text would be made of, one short answer follows many prompts, and the same text cut at another
place is another pair: all kept. A pair longer than a sample is dropped before dedup, so that it takes no
copy of itself that fits with it."""

import random

import pytest
from test_data_build import opts, quiet, store_documents
from test_instruction_pairs import _build, _jsonl

from longctx.data.builder.dedup import Deduper, instruction_hash, instruction_parts, signature
from longctx.data.builder.pipeline import build_store

WORDS = [f"w{i}" for i in range(400)]


def _text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _changed(text, at):
    """The text with word `at` replaced (a near copy)."""
    words = text.split()
    words[at] = "changed"
    return " ".join(words)


def test_pairs_are_copies_only_where_both_prompt_and_answer_are(tmp_path):
    rng = random.Random(0)
    document = _text(rng, 600) + "\nQuestion: "
    answers = [_text(rng, 200) for _ in range(3)]
    pairs = [(document + f"what is said of w{i}?", " " + answers[i]) for i in range(3)]  # one long prompt
    pairs += [(_text(rng, 300) + " 2 + 2?", " 4"), (_text(rng, 300) + " 8 / 2?", " 4")]  # one short answer
    pairs += [(_changed(pairs[0][0], 5), _changed(pairs[0][1], 7))]  # a near copy of the first: removed
    pairs += [pairs[1]]  # an exact copy: removed
    pairs += [("A stitch in time", " saves nine." + " x" * 40), ("A stitch in time saves", " nine." + " x" * 40)]
    for dedup in ("minhash", "exact"):
        root, manifest = _build(tmp_path, [_jsonl(tmp_path / "p.jsonl", pairs)], seq_len=8192, eval_fraction=0.0,
                                dedup=dedup, name=f"store-{dedup}")
        counts = manifest["parts"][0]["counts"]
        near = 1 if dedup == "minhash" else 0
        assert (counts["exact_duplicates"], counts["near_duplicates"]) == (1, near), counts
        assert counts["documents_kept"] == len(pairs) - 1 - near == len(store_documents(root))


def test_a_plain_document_is_no_copy_of_a_pairs_answer(tmp_path):
    """A text file that holds a pair's answer (or prompt) stays: a pair and a plain document are never copies."""
    rng = random.Random(1)
    prompt, answer = _text(rng, 100), _text(rng, 200)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text(answer + "\n")
    (plain / "b.txt").write_text(prompt + "\n")
    root, manifest = _build(tmp_path, [_jsonl(tmp_path / "p.jsonl", [(prompt, answer)]), plain], eval_fraction=0.0,
                            seq_len=2048)
    assert manifest["parts"][0]["counts"]["documents_kept"] == 3


def test_a_pair_that_fits_is_kept_beside_its_longer_copy_that_does_not(tmp_path):
    rng = random.Random(2)
    context = _text(rng, 300)
    pairs = [(context + " " + _text(rng, 15) + " first?", " yes"), (context + " second?", " yes"),
             (_text(rng, 40), " other")]
    lengths = [len(p) + len(r) + 1 for p, r in pairs]  # (the byte tokenizer: a token a byte, and the EOS)
    seq = lengths[1] + 8
    assert lengths[0] > seq >= max(lengths[1:])
    said = []
    manifest = build_store(opts([_jsonl(tmp_path / "p.jsonl", pairs)], tmp_path / "s", seq_len=seq, dedup="minhash",
                                strategy="bfd", eval_fraction=0.0, text_field="prompt", response_field="response"),
                           log=said.append)
    counts = manifest["parts"][0]["counts"]
    assert counts["skipped"] == {"pair_longer_than_sample": 1} and counts["documents_kept"] == 2
    assert counts["near_duplicates"] == 0 and any("dropped 1 instruction pair(s)" in line for line in said)
    kept = sorted(len(d) for d in store_documents(tmp_path / "s").values())
    assert kept == sorted(lengths[1:])


def test_an_append_finds_exact_copies_of_earlier_pairs_and_keeps_other_answers(tmp_path):
    """An earlier part keeps its pairs' exact hashes (found again) and signatures of their answers alone, which
    it cannot confirm a prompt by: another answer on the same prompt is kept, an exact copy is not."""
    rng = random.Random(3)
    prompt = _text(rng, 500)
    first = [(prompt, " " + _text(rng, 100))]
    root, _ = _build(tmp_path, [_jsonl(tmp_path / "a.jsonl", first)], seq_len=4096, eval_fraction=0.0)
    more = [first[0], (prompt, " " + _text(rng, 100))]
    manifest = build_store(opts([_jsonl(tmp_path / "b.jsonl", more)], root, seq_len=4096, dedup="minhash",
                                strategy="bfd", eval_fraction=0.0, text_field="prompt", response_field="response",
                                append=True), log=quiet)
    counts = manifest["parts"][-1]["counts"]
    assert (counts["exact_duplicates"], counts["near_duplicates"], counts["documents_kept"]) == (1, 0, 1)


@pytest.mark.parametrize("kind", ["prompt", "answer"])
def test_the_deduper_confirms_a_pair_by_both_its_parts(kind):
    """Deduper alone: two pairs whose answers (signed) are equal are copies only if their prompts are near
    too; whose prompts are equal, only if their answers are."""
    rng = random.Random(4)
    prompt, answer = _text(rng, 300), _text(rng, 300)
    other = _text(rng, 300)
    texts = [prompt + answer, (other + answer) if kind == "prompt" else (prompt + other)]
    switches = [(len(prompt),), (len(other) if kind == "prompt" else len(prompt),)]
    deduper = Deduper("minhash", 0.8, text_of=lambda i: texts[i], sig_of=lambda i: signature(
        instruction_parts(texts[i], switches[i])[1]), switches_of=lambda i: switches[i])
    found = [deduper.check(i, instruction_hash(texts[i], switches[i]), deduper.sig_of(i)) for i in range(2)]
    assert found == [None, None] and deduper.near == 0
    copy = _changed(prompt, 3) + _changed(answer, 9)
    texts.append(copy)
    switches.append((len(_changed(prompt, 3)),))
    assert deduper.check(2, instruction_hash(copy, switches[2]), deduper.sig_of(2)) == "near"
