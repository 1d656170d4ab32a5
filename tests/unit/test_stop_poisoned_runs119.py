"""Stop strings in a long run of byte-fallback tokens that a stray byte poisons (generate/output.py StopStrings).

The row's decoding has such a run as one U+FFFD per byte, but the cheap tail the check reads first begins inside
the run and shows its later bytes as text; where that text holds a stop string the check confirmed the match on
the exact tail, a walk back to the run's start and a decoding of all of it, at every token of the run: 8,000
newline bytes after a stray byte took 15 s of checks (about 2 ms a token, growing with the run). A last token
inside such a run adds U+FFFD and nothing else, so it can end no stop string without one: known from the run,
remembered for the row's own token list.

The fuzz below checks that every row of pieces, byte runs, stray bytes and special tokens, after prompts that end
inside a character, ends where its whole text (continuation_text) first holds a stop string. It found a row that
ended early before this change too: after a prompt ending in a stray <0xE6>, the row's first bytes (valid on their
own: "\n\n\nAAA\n\n") are U+FFFD in its text, but a tail begun inside them read them as text, and --stop "\n"
ended the row at its 11th token, 3 before its first newline (the exact tail now reads such a run after the
prompt, as the line does). 1 row in about 600 of its first draws (now test_review119a's rows)."""

import random

import pytest

pytest.importorskip("tokenizers")

from test_generate_audit2_stop_byte_runs import _llama_like  # noqa: E402
from test_review118b import _Counting  # noqa: E402
from test_review119a import _row  # noqa: E402

from longctx.generate.output import StopStrings  # noqa: E402
from longctx.generate.row_text import continuation_text  # noqa: E402


def _checked(stops: StopStrings, tokens: list[int]) -> int | None:
    """The token (1-based count) a row appended one at a time, as the decode loop does, ends at."""
    out: list[int] = []
    for n, t in enumerate(tokens, 1):
        out.append(t)
        if stops(0, out):
            return n
    return None


def test_a_long_poisoned_run_costs_each_token_a_bounded_decoding(tmp_path):
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    counted = _Counting(tok)
    run = 4000
    tokens = [ids["Answer:"], 0xE6, *[0x0A] * run]  # a stray byte, then a run of newlines the row has as U+FFFD
    stops = StopStrings(counted, ["\n\n"])
    stops.rows([[ids["▁"], ids["Question:"]]])
    assert _checked(stops, tokens) is None
    # each token decodes its tail (a few times the window); before, the run back to its start, twice
    assert counted.decoded < 100 * len(tokens), f"{counted.decoded / len(tokens):.0f} ids decoded per token"


def test_rows_end_where_their_whole_text_first_holds_a_stop_string(tmp_path):
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    special = tok.special_tokens()["</s>"]
    rng = random.Random(119)
    prompts = [[ids["▁"], ids["Question:"]], [ids["Question:"], 0xE6], [ids["Question:"], 0xE6, 0x80],
               [ids["Answer:"], 0x0A]]  # the last two end inside a character or on a newline byte
    checked = ended_somewhere = 0
    for _ in range(2000):
        prompt, tokens = rng.choice(prompts), _row(rng, ids, special)  # (a leading <0x80><0x80> at times)
        stop_list = rng.choice([["\n\n"], ["\n"], ["yes\n"], ["\ufffd\n"], ["€\n", "no"]])
        stops = StopStrings(tok, stop_list)
        stops.rows([prompt])
        want = next((n for n in range(1, len(tokens) + 1)
                     if any(s in continuation_text(tok, prompt, tokens[:n]) for s in stop_list)), None)
        got = _checked(stops, tokens)
        assert got == want, (prompt, tokens, stop_list, continuation_text(tok, prompt, tokens))
        checked += 1
        ended_somewhere += want is not None
    assert checked == 2000 and ended_somewhere > 400
