

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
