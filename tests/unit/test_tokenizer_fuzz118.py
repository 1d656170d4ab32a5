"""A randomized audit of longctx's tokenizer paths against the `tokenizers` and `transformers` libraries called
directly (tests/tokenizer_fuzz118_reference.py: the rules, and five small tokenizer.json files trained here:
byte-level BPE, Metaspace BPE with NFKC, Llama-2's byte-fallback BPE, BERT's WordPiece, a Unigram; each with added
special tokens), and the byte tokenizer against Python's UTF-8 codec.

Random texts mix ASCII, CJK, emoji with ZWJ, combining marks, RTL and bidi controls, control characters, CR LF,
very long words, special tokens' strings as text and empty strings. Checked:
- data/tokenizer.py: ids, a prompt's ids with and without post-processing, the prefix, equal the library's;
- builder/tokenize.py: a document's tokens (prefix, ids, EOS) and cut points, alone and batched;
- a `longctx data build` of the texts: each document's stored tokens are the library's, and 1 and 2 workers
  build bitwise the same store; a prompt is encoded with the ids the store holds for its text;
- generate/output.py, fed new ids one at a time as the engine does (random ids, real texts' ids, characters
  split over byte tokens): the text after every token is the pipeline's (decode(prompt + new) less
  decode(prompt)); the streamed pieces join into the JSON text, are a prefix of it at every step (no U+FFFD that
  the final text lacks: a partial character is held back), and show all they may once the text is final; stop
  strings end the row at the first token whose text holds one (inside a token, across tokens; one that straddles
  the prompt/continuation boundary only where it occurs in the continuation) and cut it at the first.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import random
import sys

import pytest

import longctx.progress
import tokenizer_fuzz118_reference as ref
from longctx.data import store
from longctx.data.builder import scan, scan_pool
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.builder.tokenize import tokenize, tokenize_one
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer
from longctx.generate.output import Output, continuation_text
from longctx.generate.results import Result

KINDS = (*ref.KINDS, "byte")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{kind: (longctx's tokenizer, the reference library's, transformers')}; the byte tokenizer's references are
    Python's UTF-8 codec (ByteReference)."""
    d = tmp_path_factory.mktemp("tok118")
    out = {"byte": (ByteTokenizer(), None, ByteReference())}
    for kind in ref.KINDS:
        path = ref.build(kind, d)
        out[kind] = (HFTokenizer(path), ref.library(path), ref.transformers_tokenizer(path))
    return out


class ByteReference:
    """The byte tokenizer's text as its docs define it: ids 0..255 the UTF-8 bytes, others (BOS, EOS) no text."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def has_special_string(text: str) -> bool:
    return any(s in text for s in (*ref.EOS.values(), *ref.CHAT, "<s>", "<unk>", "[UNK]", "[CLS]"))


# -- ids ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ref.KINDS)
def test_ids_prefix_and_cut_points_are_the_library_s(tokenizers, kind):
    tok, lib, _ = tokenizers[kind]
    rng = random.Random(f"ids {kind}")
    texts = [ref.random_text(rng) for _ in range(80)]
    assert tok.text_prefix() == ref.prefix_of(lib)
    assert tok.eos_id == lib.token_to_id(ref.EOS[kind])
    assert [e.tolist() for e in tok.encode_batch(texts)] == [ref.ids_of(lib, t) for t in texts], \
        "a document's ids are not the library's (special-token strings read as text)"
    batched = tokenize(texts, tok, workers=2, batch=7)
    for i, text in enumerate(texts):
        # a prompt: the tokenizer's usual reading of special-token strings, as transformers encodes it
        assert tok.encode(text).tolist() == ref.ids_of(lib, text, special_as_text=False), text
        assert tok.encode(text, add_special_tokens=True).tolist() == ref.ids_of(lib, text, False, post=True), text
        tokens, breaks, strong = tokenize_one(text, tok)
        assert tokens.tolist() == ref.document(lib, kind, text), f"the store's tokens of {text!r}"
        lib.encode_special_tokens = True
        want = ref.cut_points(text, lib.encode(text, add_special_tokens=False).offsets)
        lib.encode_special_tokens = False
        n = len(tok.text_prefix())
        assert (breaks.tolist(), strong.tolist()) == ([b + n for b in want[0]], [s + n for s in want[1]]), text
        assert [a.tolist() for a in (batched.tokens[i], batched.breaks[i], batched.strong[i])] == \
            [tokens.tolist(), breaks.tolist(), strong.tolist()], "batched tokenize differs from tokenize_one"
        if not has_special_string(text):  # build and generate read a text alike (docs/generate.md: the prefix)
            assert [*tok.text_prefix(), *tok.encode(text).tolist()] == tokens.tolist()[:-1]


def test_byte_tokenizer_ids_are_utf8_bytes_lone_surrogates_replaced():
    tok, rng = ByteTokenizer(), random.Random("byte ids")
    texts = [ref.random_text(rng) for _ in range(60)] + ["a\ud800b", "\udfff", ""]
    for text in texts:
        raw = text.encode("utf-8", errors="replace")  # (a lone surrogate, which the API takes, is '?')
        assert tok.encode(text).tolist() == list(raw)
        assert tokenize_one(text, tok)[0].tolist() == [*raw, tok.eos_id]
        assert tok.decode(tok.encode(text)) == raw.decode("utf-8")


# -- the build ------------------------------------------------------------------------------------------

def stored_documents(root) -> list[list[int]]:
    """Each document's tokens, gathered from the train split's segments (sample, offset, length, doc, start)."""
    docs: dict[int, list] = {}
    for part in store.read_manifest(root)["parts"]:
        arrays = store.load_split(root, part, "train")
        for sample, off, n, doc, start in arrays.segments.tolist():
            docs.setdefault(doc, []).append((start, arrays.tokens[sample, off:off + n].tolist()))
    return [[t for _, piece in sorted(docs[d]) for t in piece] for d in sorted(docs)]


def store_files(root) -> dict:
    m = store.read_manifest(root)
    files = {(p["dir"], f.name): f.read_bytes() for p in m["parts"] for f in sorted((root / p["dir"]).iterdir())}
    return {"files": files, "parts": [{k: v for k, v in p.items() if k not in ("created", "stages")}
                                      for p in m["parts"]]}  # (not its seconds)


@pytest.mark.parametrize("kind", KINDS)
def test_a_build_stores_the_library_s_ids_the_same_with_one_and_two_workers(tokenizers, kind, tmp_path, monkeypatch):
    tok, lib, _ = tokenizers[kind]
    rng = random.Random(f"build {kind}")
    texts = [f"{i} {ref.random_text(rng)}" for i in range(40)]
    records = [json.dumps({"text": t}) for t in texts] + ['{"text": "\\ud800 lone"}', '{"text": " \\r\\n"}']
    rng.shuffle(records)
    src = tmp_path / "in"
    src.mkdir()
    for k in range(10):  # (files sorted by name: read in this order)
        (src / f"{k}.jsonl").write_text("\n".join(records[5 * k:5 * k + 5]) + "\n")
    monkeypatch.setattr(scan, "SHARD_BYTES", 3000)  # several shards of several files, spread over the workers
    monkeypatch.setattr(scan_pool, "worker_context", lambda: mp.get_context("fork"))
    pooled = []  # (the shards the 2 workers were given, and the most files in one: the pool did run)
    monkeypatch.setattr(scan, "scan_in_workers", lambda fn, jobs, *a, **kw: pooled.append(
        (len(jobs), max(len(job[2]) for job in jobs))) or scan_pool.scan_in_workers(fn, jobs, *a, **kw))
    spec = "byte" if kind == "byte" else tok.name
    for workers in (1, 2):
        build_store(BuildOptions(inputs=[str(src)], out=str(tmp_path / f"w{workers}"), tokenizer=spec, seq_len=64,
                                 dedup="none", eval_fraction=0.0, workers=workers, progress=False), log=lambda *_: 0)
    order = [json.loads(r)["text"] for r in records]
    kept = [t for t in map(ref.store_text, order) if t is not None and "\ud800" not in t]
    want = [[*t.encode(), 257] if kind == "byte" else ref.document(lib, kind, t) for t in kept]
    assert stored_documents(tmp_path / "w1") == want, "the store's tokens are not the library's ids of the texts"
    assert pooled and min(pooled[0]) >= 2
    assert store_files(tmp_path / "w2") == store_files(tmp_path / "w1"), "2 workers built another store than 1"


# -- generate's text ------------------------------------------------------------------------------------

def new_ids(rng, kind, tok, lib) -> list[int]:
    """What a model may generate: any ids (special tokens, byte pieces, in any order), a text's own ids, a text's
    characters split over single-byte tokens, or those with special tokens (which decode to nothing) among them."""
    size = 258 if kind == "byte" else lib.get_vocab_size()
    how = rng.randrange(4)
    text = ref.random_text(rng, rng.randint(1, 8))
    if how == 0 or not text:
        return [rng.randrange(size) for _ in range(rng.randint(1, 30))]
    if how == 1 or kind not in ("byte", "bytelevel_bpe", "bytefallback_bpe"):
        ids = [int(t) for t in tok.encode(text)] or [rng.randrange(size)]
    elif kind == "byte":
        ids = list(text.encode())
    elif kind == "bytelevel_bpe":  # (each byte's own token: the ByteLevel alphabet character it maps to)
        ids = [lib.token_to_id(ref.byte_level_char(b)) for b in text.encode()]
    else:
        ids = [lib.token_to_id(f"<0x{b:02X}>") for b in text.encode()]
    silent = sorted(tok.special_tokens().values()) if kind != "byte" else [256, 257]
    for _ in range(rng.randint(1, 6) if how == 3 else 0):
        ids.insert(rng.randint(0, len(ids)), rng.choice(silent))
    return ids


def random_stops(rng, prompt_text: str, text: str, special: dict) -> list[str]:
    """Stop strings: pieces of the final text (inside a token or across tokens), one that straddles the
    prompt/continuation boundary, a special token's text, one that never occurs."""
    clean = text.replace("\ufffd", "")
    stops = []
    for _ in range(rng.randint(0, 3)):
        if clean:
            a = rng.randrange(len(clean))
            stops.append(clean[a:a + rng.randint(1, 9)])
    if rng.random() < 0.4 and prompt_text and clean:
        stops.append(prompt_text[-rng.randint(1, 3):] + clean[:rng.randint(1, 3)])
    if rng.random() < 0.2 and special:
        stops.append(rng.choice(sorted(special)))
    if rng.random() < 0.3:
        stops.append("\x00never")
    # (one holding a special token's text among other text is refused: test_generate_special_stop.py)
    return [s for s in stops if s and (s in special or not any(t in s for t in special))]


class Recorder(io.StringIO):
    """stderr: the stream's pieces, each with the number of tokens generated when it was written."""

    def __init__(self):
        super().__init__()
        self.pieces, self.step = [], 0

    def write(self, s):
        self.pieces.append((self.step, s))
        return len(s)


def generate(tok, prompt: dict, ids: list[int], stops: list[str], monkeypatch):
    """(the JSON line, the stream's pieces) of a row that generates `ids` (until a stop ends it), the output and
    the stop check called as the engine calls them: the token streamed, then the stop checked."""
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
    err = Recorder()
    monkeypatch.setattr(sys, "stderr", err)
    output = Output(tok, stops, "", 1, len(ids), main_rank=True)
    output.file = io.StringIO()
    output.rows([prompt["ids"]])
    tokens, reason = [], "length"
    for t in ids:
        tokens.append(t)
        err.step = len(tokens)
        output.on_token(0, t)
        if output.stops is not None and output.stops(0, tokens):
            reason = "stop"
            break
    output.write(prompt, Result(len(prompt["ids"]), tokens, reason, 1.0, 1.0), speculative=False)
    return json.loads(output.file.getvalue()), err.pieces


def check_row(tok, lib, hf, special, prompt, ids, stops, monkeypatch):
    texts = [ref.continuation(hf, prompt["ids"], ids[:k]) for k in range(1, len(ids) + 1)]
    for k in sorted({1, len(ids), len(ids) // 2 + 1}):
        assert continuation_text(tok, prompt["ids"], ids[:k]) == texts[k - 1], \
            f"the text of {ids[:k]} after the prompt {prompt['ids']} is not the pipeline's"
    k, want = ref.stop_at(texts, ids, stops, special)
    line, pieces = generate(tok, prompt, ids, stops, monkeypatch)
    assert line["tokens"] == ids[:k or len(ids)], f"stops {stops!r}: the row ended elsewhere than at its first"
    assert (line["text"], line["finish_reason"]) == (want, "stop" if k else "length"), stops
    shown = pieces[:-1]  # (the last: the rest of the text and a newline, written by finish)
    assert pieces[-1][1].endswith("\n") and "".join(p for _, p in pieces)[:-1] == want, \
        "the streamed pieces do not join into the JSON text"
    text_stops = [s for s in stops if s not in special]
    for step in range(1, (k or len(ids)) + 1):
        so_far = "".join(p for at, p in shown if at <= step)
        assert want.startswith(so_far), f"after {step} tokens the stream showed {so_far!r}, not a prefix of {want!r}"
        if "\ufffd" not in texts[step - 1]:  # (every character final: all of it shown but a stop's beginning)
            held = ref.open_run(lib, ids[:step]) if lib is not None else 0
            assert so_far == ref.shown_at_most(texts[step - 1], text_stops, held), f"after {step} tokens, {stops}"


@pytest.mark.parametrize("kind", KINDS)
def test_generated_text_streams_and_stops_as_the_pipeline_reads_it(tokenizers, kind, monkeypatch):
    tok, lib, hf = tokenizers[kind]
    special = tok.special_tokens() if kind != "byte" else {}
    rng = random.Random(f"generate {kind}")
    for _ in range(60):
        text = ref.random_text(rng) or "x"
        if kind != "byte" and rng.random() < 0.5:  # (hf:DIR: the tokenizer's post-processing, as transformers)
            ids = tok.encode(text, add_special_tokens=True).tolist()
        else:  # (a longctx checkpoint: the prefix its documents began with, the text's ids)
            ids = [*(tok.text_prefix() if kind != "byte" else []), *tok.encode(text).tolist()]
        prompt = {"text": text, "ids": ids or [tok.eos_id]}
        new = new_ids(rng, kind, tok, lib)
        final = ref.continuation(hf, prompt["ids"], new)
        stops = random_stops(rng, hf.decode(prompt["ids"], skip_special_tokens=True), final, special)
        check_row(tok, lib, hf, special, prompt, new, stops, monkeypatch)


def test_the_first_space_of_a_sentencepiece_continuation_is_kept_and_can_stop_it(tokenizers, monkeypatch):
    """'▁', 'world' after 'hello': ' world', as the pipeline reads it; decoded alone it is 'world' (Strip)."""
    tok, lib, hf = tokenizers["bytefallback_bpe"]
    prompt = {"text": "hello", "ids": [*tok.text_prefix(), *tok.encode("hello").tolist()]}
    new = ref.ids_of(lib, "hello world")[len(ref.ids_of(lib, "hello")):]
    assert (ref.continuation(hf, prompt["ids"], new), tok.decode(new)) == (" world", "world")
    check_row(tok, lib, hf, {}, prompt, new, [" w"], monkeypatch)
    assert generate(tok, prompt, new, [" w"], monkeypatch)[0]["text"] == ""


@pytest.mark.parametrize("tail", [["<0xBB>", "▁", "he"], ["<0xE4>"], ["<0x41>", "<|im_end|>", "<0x80>", "a"]])
def test_a_run_of_byte_tokens_is_shown_once_no_stray_byte_can_follow(tokenizers, tail, monkeypatch):
    """A tab as a byte token, then a stray byte (or a character the row ends inside): the ByteFallback decoder
    writes the whole run as U+FFFD, the tab too, so the stream may not have shown the tab (it did, before)."""
    tok, lib, hf = tokenizers["bytefallback_bpe"]
    prompt = {"text": "hello", "ids": [*tok.text_prefix(), *tok.encode("hello").tolist()]}
    new = [lib.token_to_id("<0x09>"), *map(lib.token_to_id, tail)]
    assert "\t" not in ref.continuation(hf, prompt["ids"], new) and "\ufffd" in ref.continuation(hf, prompt["ids"], new)
    check_row(tok, lib, hf, tok.special_tokens(), prompt, new, [], monkeypatch)


def test_the_eos_is_the_special_token_not_a_word_that_spells_a_candidate(tmp_path):
    """A vocabulary that learnt "<|endoftext|>" as a word from its corpus, and whose special end token is "</s>":
    documents end with "</s>" (they ended with the word, which a document's own text encodes to)."""
    from tokenizers import Tokenizer, models

    lib = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1, "a": 2, "</s>": 3}, unk_token="[UNK]"))
    lib.add_special_tokens(["</s>"])
    lib.save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizer(tmp_path / "tokenizer.json").eos_id == 3


@pytest.mark.parametrize("kind", ["bytelevel_bpe", "byte"])
def test_a_stop_string_across_the_prompt_boundary_is_matched_in_the_continuation_only(tokenizers, kind, monkeypatch):
    """"wor" + "ld": the stop "world" straddles the prompt's end, which the text (the continuation) never holds
    whole; the row ends where the continuation writes it, its text cut there (docs/generate.md: `text`)."""
    tok, lib, hf = tokenizers[kind]
    prompt = {"text": "hello wor", "ids": tok.encode("hello wor").tolist()}
    new = tok.encode("ld and world!").tolist()
    line, _ = generate(tok, prompt, new, ["world"], monkeypatch)
    assert (line["text"], line["finish_reason"]) == ("ld and ", "stop")
    check_row(tok, lib, hf, {}, prompt, new, ["world"], monkeypatch)
    assert generate(tok, prompt, new[:2], ["world"], monkeypatch)[0]["finish_reason"] == "length"
