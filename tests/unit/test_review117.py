"""Review of session 117's mends. The stop check's cost on a prompt that ends in a long run of byte tokens: the row's
text is read after prompt_context's ids, which since 2026-12-07 walks such a run back to its first token (to find
a stray byte that poisons it), and the stop check asked for that context again at each of a row's first checks,
so each cost a walk over the whole run (a prompt of 100K byte tokens: about 70 ms a check, 2.8 s for a row's first
40 tokens, where it had cost under 1 ms). The context is found once per prompt (StopStrings.rows)."""

import pytest

pytest.importorskip("tokenizers")

from test_generate_audit2_stop_byte_runs import _llama_like  # noqa: E402

from longctx.generate.output import StopStrings, continuation_text  # noqa: E402


class _CountedIds(list):
    """A prompt's ids that count how many of them are read (by index or by slice)."""

    reads = 0

    def __getitem__(self, key):
        item = super().__getitem__(key)
        _CountedIds.reads += len(item) if isinstance(key, slice) else 1
        return item


@pytest.mark.parametrize("run", ["valid", "a stray byte first"])
def test_the_stop_check_does_not_read_a_long_prompt_again_at_each_token(tmp_path, run):
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    n = 20_000
    stray = [0xE6] if run != "valid" else []  # (<0xE6>: the first byte of a 3-byte character, alone)
    prompt = _CountedIds([ids["▁"], ids["Question:"], *stray, *[0x61] * n])  # ('a' as n byte tokens)
    tokens = [*[ids["▁yes"]] * 30, ids["▁no"], *[ids["▁yes"]] * 9]
    stops = StopStrings(tok, [" no yes"])
    stops.rows([prompt], samples=2)
    before = _CountedIds.reads
    ended = [k for k in range(1, len(tokens) + 1) if stops(1, tokens[:k])]
    reads = _CountedIds.reads - before
    assert reads <= 100, f"{len(tokens)} stop checks read {reads} of the prompt's {len(prompt)} ids"
    # (and they decide as before: the first token after which the row's text holds the stop string)
    text = [continuation_text(tok, list(prompt), tokens[:k]) for k in range(1, len(tokens) + 1)]
    assert ended[0] == next(k for k, t in enumerate(text, 1) if " no yes" in t) == 32
