"""Review of 7f273663 (generate/output.py Stream holding back an open byte-fallback run; data/tokenizer.py's EOS a
special candidate first): the text a terminal is shown against the JSON line's where the prompt's ids end inside a
character or in a run of byte tokens that the continuation's first bytes poison (the line's text is then the new
ids alone: text_after); the work per token inside a long run of byte tokens; an append to a store whose documents
end with the EOS the old rule chose."""

import io
import json

import pytest

import longctx.progress
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer
from longctx.generate.output import Output
from longctx.generate.results import Result


def _shown_and_text(tok, prompt_ids, new, monkeypatch, capsys):
    """(what the terminal showed after each new token, all it showed, the JSON line's text) of a row generating
    `new` after `prompt_ids`."""
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
    output = Output(tok, [], "", 1, len(new), main_rank=True)
    output.file = io.StringIO()
    output.rows([prompt_ids])
    steps, shown = [], ""
    for t in new:
        output.on_token(0, t)
        shown += capsys.readouterr().err
        steps.append(shown)
    output.write({"text": "p"}, Result(len(prompt_ids), list(new), "length", 1.0, 1.0), speculative=False)
    shown += capsys.readouterr().err
    assert shown.endswith("\n")
    return steps, shown[:-1], json.loads(output.file.getvalue())["text"]


def _llama_like(tmp_path) -> HFTokenizer:
    """A Llama-2-like tokenizer.json: <0x00>..<0xFF> byte pieces, a ByteFallback decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "hello": 5}
    vocab.update({f"<0x{b:02X}>": 6 + b for b in range(256)})
    lib = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    lib.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    lib.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    lib.add_special_tokens(["<s>", "</s>"])
    lib.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path / "tokenizer.json")


def test_a_prompt_ending_inside_a_character_streams_the_line_s_text(monkeypatch, capsys):
    """The prompt ends with é's first byte: the line's text is the new ids decoded alone ('\ufffda', text_after),
    where the stream cut the whole decoding ('...éa') at the prompt's length and showed 'a', then 'a' again."""
    tok = ByteTokenizer()
    prompt = [*b"hello ", 0xC3]
    steps, shown, text = _shown_and_text(tok, prompt, [0xA9, ord("a")], monkeypatch, capsys)
    assert text == "\ufffda"
    assert all(text.startswith(s) for s in steps), f"the terminal showed {steps}, not a prefix of {text!r}"
    assert shown == text


@pytest.mark.parametrize("new", [["<0xBB>", "a"], ["<0xBB>", "▁", "hello"], ["<0x41>", "<0xBB>", "a"]])
def test_a_prompt_ending_in_a_byte_run_that_the_continuation_poisons(tmp_path, new, monkeypatch, capsys):
    """The prompt ends with é as two byte tokens; a stray byte after them makes the decoder write the run as
    U+FFFD, so the prompt's text is no prefix of the whole and the line's text is the new ids alone. The stream
    cut the whole decoding at the prompt's length and showed one U+FFFD more than the line has."""
    tok = _llama_like(tmp_path)
    vocab = tok._tok.get_vocab()
    prompt = [1, vocab["hello"], vocab["<0xC3>"], vocab["<0xA9>"]]
    ids = [vocab[t] for t in new]
    steps, shown, text = _shown_and_text(tok, prompt, ids, monkeypatch, capsys)
    assert text == tok.decode(ids) and text.startswith("\ufffd")
    assert all(text.startswith(s) for s in steps), f"the terminal showed {steps}, not a prefix of {text!r}"
    assert shown == text


class _Counting:
    """A tokenizer whose decode counts the ids it is given (the stream's work per token)."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def test_a_long_run_of_byte_tokens_is_not_decoded_whole_per_token(tmp_path, monkeypatch, capsys):
    """600 words, then 300 characters the vocabulary lacks as 900 byte tokens: a partial character's bytes decode
    as U+FFFD, no prefix of the settled text, and the stream decoded the whole row for 2 of every 3 byte tokens
    (O(n) a token: 20000 such tokens took minutes). It decodes nothing inside the run now, the run once at its end."""
    tok = _Counting(_llama_like(tmp_path))
    vocab = tok.tok._tok.get_vocab()
    run = [vocab[f"<0x{b:02X}>"] for b in ("ᚠ" * 300).encode()]
    new = [vocab["hello"], vocab["▁"]] * 300 + run + [vocab["a"]]
    tok.decoded = 0
    steps, shown, text = _shown_and_text(tok, [1, vocab["hello"]], new, monkeypatch, capsys)
    assert shown == text and text.endswith(" " + "ᚠ" * 300 + "a")
    assert tok.decoded < 40 * len(new), f"{tok.decoded} ids decoded for {len(new)} tokens: the whole row per token"
    assert all(s == steps[600] for s in steps[600:-1]), "the run was shown before it ended"


def test_an_append_to_a_store_that_ended_documents_with_the_old_eos_is_refused(tmp_path):
    """A vocabulary with '<|endoftext|>' as a plain word and '</s>' special: a store built before 7f273663 ended
    its documents with the word (its manifest's eos_id); an append now ends them with '</s>'. It mixed the two
    silently, the manifest then naming '</s>' for every part."""
    from test_data_build import opts, quiet
    from tokenizers import Tokenizer, models, pre_tokenizers

    from longctx.data import store
    from longctx.data.builder.pipeline import build_store
    from longctx.errors import DataError

    lib = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1, "a": 2, "b": 3, "</s>": 4}, unk_token="[UNK]"))
    lib.pre_tokenizer = pre_tokenizers.Whitespace()
    lib.add_special_tokens(["</s>"])
    lib.save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizer(tmp_path / "tokenizer.json").eos_id == 4
    first, more = tmp_path / "first", tmp_path / "more"
    for d, n in ((first, 6), (more, 3)):
        d.mkdir()
        for i in range(n):
            (d / f"{d.name}{i}.txt").write_text("a b " * (5 + i))

    def build(inputs, **kw):
        return build_store(opts([inputs], tmp_path / "s", 32, tokenizer=str(tmp_path / "tokenizer.json"),
                                strategy="bfd", dedup="none", eval_fraction=0.0, **kw), log=quiet)

    build(first)
    manifest = store.read_manifest(tmp_path / "s")
    manifest["tokenizer"]["eos_id"] = 1  # as built before: the word '<|endoftext|>' ended each document
    store.write_manifest(tmp_path / "s", manifest)
    with pytest.raises(DataError, match="ends its documents with token id 1, .* ends each with 4"):
        build(more, append=True)
