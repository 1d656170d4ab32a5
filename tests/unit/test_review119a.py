"""Review of e608362d / 674c485b (stop strings after a prompt ending in a stray byte; a poisoned run's last token
ends no stop string without U+FFFD) and 5837a4c9 (GGUF import: invented tokens, check_tensors,
check_architecture).

The stop strings are checked here through the decode loop's own bookkeeping (generate/loop.py _Book: several rows,
prompt-major with their samples, each taking the tokens of a round one at a time, as speculation's rounds of several
kept tokens do) against each row's whole text (continuation_text), and the terminal stream against the JSON line."""

import io
import json
import random

import pytest
import torch

pytest.importorskip("tokenizers")

from test_generate_audit2_stop_byte_runs import PIECES, _llama_like  # noqa: E402
from test_review118b import _Counting  # noqa: E402

import longctx.progress  # noqa: E402
from longctx.generate import row_text  # noqa: E402
from longctx.generate.contracts import Round  # noqa: E402
from longctx.generate.loop import Row, _Book  # noqa: E402
from longctx.generate.output import Output, StopStrings  # noqa: E402
from longctx.generate.results import Result  # noqa: E402
from longctx.generate.row_text import continuation_text  # noqa: E402

STOPS = [["\n\n"], ["\n"], [" yes\n"], ["\ufffd\n"], ["€\n", " no"], ["\ufffd yes"], ["\ufffd\ufffd\ufffd\ufffd"],
         ["A\ufffd"], ["\n\ufffd", "Answer:"], ["yes\ufffd"],
         ["\ufffd yes\n"]]


def _prompts(ids: dict, special: int) -> list[list[int]]:
    """Prompt endings: a piece, a newline byte, a stray lead byte, a character's first two of three bytes, a lone
    continuation byte, a complete two-byte character, a valid ASCII byte, a special token after a stray byte, none."""
    q = ids["Question:"]
    return [[ids["▁"], q], [ids["Answer:"], 0x0A], [q, 0xE6], [q, 0xE6, 0x80], [q, 0x80], [q, 0xC3, 0xA9],
            [q, 0x41], [q, 0xE6, special], [q, 0xF0, 0x9F], []]


def _row(rng: random.Random, ids: dict, special: int) -> list[int]:
    """Pieces, valid characters as bytes, newline bytes, stray bytes, special tokens, and long byte runs (longer
    than the stop strings' window, so a tail begins inside them)."""
    parts: list[int] = []
    for _ in range(rng.randint(1, 10)):
        kind = rng.random()
        if kind < 0.25:
            parts.append(ids[rng.choice(PIECES)])
        elif kind < 0.45:
            parts.extend(rng.choice([list("€".encode()), list("é".encode()), [0x0A], [0x41]]) * rng.randint(1, 3))
        elif kind < 0.6:
            parts.extend([0x0A] * rng.randint(1, 4))
        elif kind < 0.72:
            parts.append(rng.choice([0xE6, 0x80, 0xC3]))  # a stray lead byte or a lone continuation byte
        elif kind < 0.8:
            parts.append(special)
        else:
            parts.extend(rng.choice([[0x0A], [0x41], list("€".encode())]) * rng.randint(10, 30))
    # (the rest of a character the prompt may have begun: a row's first run that the prompt's last bytes join)
    return [0x80, 0x80, *parts] if rng.random() < 0.25 else parts


def _want(tok, prompt: list[int], tokens: list[int], stops: list[str]) -> int | None:
    return next((n for n in range(1, len(tokens) + 1)
                 if any(s in continuation_text(tok, prompt, tokens[:n]) for s in stops)), None)


def _decoded(stops: StopStrings, prompts: list[list[int]], samples: int, rows: list[list[int]], width: int,
             rng: random.Random) -> list[Result]:
    """The rows (prompt-major, `samples` each) through _Book: rounds of 1..width tokens per row (a speculative
    round's kept proposals and the target's token), each row taking its tokens one at a time, until it ends."""
    book_rows = [Row(i, i // samples, i % samples, len(r), 0.0, None) for i, r in enumerate(rows)]
    book = _Book(book_rows, [prompts[i // samples] for i in range(len(rows))], set(), stops, None, None)
    at = 0
    while True:
        m = rng.randint(1, width)
        block = [[(r[at + j] if at + j < len(r) else 0x41) for j in range(m)] for r in rows]
        if book.take(Round(torch.tensor(block), None, kept=[m - 1] * len(rows), proposed=[m] * len(rows)), 0.0):
            return book.results()
        at += m


@pytest.mark.parametrize("seed", range(3))
def test_rows_in_rounds_end_where_their_whole_text_first_holds_a_stop_string(tmp_path, seed):
    """300 draws a seed of 1-3 prompts x 1-3 samples; stop strings with U+FFFD among them. Before the fix a stop
    string holding U+FFFD that the row's text holds inside (or right after) a run a stray byte poisons, beyond the
    window, was never seen: the cheap tail reads such a run's bytes as text (see the next test)."""
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    special = tok.special_tokens()["</s>"]
    endings = _prompts(ids, special)
    rng = random.Random(1190 + seed)
    ended = 0
    for _ in range(300):
        prompts = [rng.choice(endings) for _ in range(rng.randint(1, 3))]
        samples = rng.randint(1, 3)
        rows = [_row(rng, ids, special) for _ in range(len(prompts) * samples)]
        stop_list = rng.choice(STOPS)
        stops = StopStrings(tok, stop_list)
        stops.rows(prompts, samples)
        results = _decoded(stops, prompts, samples, rows, rng.choice([1, 4]), rng)
        for i, (row, result) in enumerate(zip(rows, results)):
            prompt = prompts[i // samples]
            want = _want(tok, prompt, row, stop_list)
            got = len(result.tokens) if result.finish_reason == "stop" else None
            assert got == want, (prompt, row, stop_list, continuation_text(tok, prompt, row))
            ended += want is not None
    assert ended > 150


@pytest.mark.parametrize("prompt_end", [[], [0xE6]])
@pytest.mark.parametrize("stop, after", [("\ufffd yes", ["▁yes"]), ("\ufffd yes\n", ["▁yes", 0x0A])])
def test_a_stop_string_with_u_fffd_after_a_long_poisoned_run_is_seen(tmp_path, prompt_end, stop, after):
    """A stray <0xE6> (in the row, or the prompt's last token), 30 newline bytes, then ' yes' (and a newline byte):
    the row's text holds U+FFFD x 31 (or 30) then ' yes', and --stop '\ufffd yes' ended nothing: the cheap tail,
    begun inside the run, read '\n' x 11 ' yes', and the exact one was never asked."""
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    prompt = [ids["Question:"], *prompt_end]
    row = [*([] if prompt_end else [ids["Answer:"], 0xE6]), *[0x0A] * 30,
           *[ids[t] if isinstance(t, str) else t for t in after], ids["▁no"]]
    assert continuation_text(tok, prompt, row[:-1]).endswith(stop)
    assert _checked(tok, prompt, [stop], row) == len(row) - 1


@pytest.mark.parametrize("row, at", [([0x41, 0x80], 3), ([0x41, 0x41, 0xE6, 0x41], 4), ([0x41] * 45 + [0xC3], 47)])
def test_a_stop_string_with_u_fffd_that_a_byte_makes_across_a_run_s_start_is_seen(tmp_path, row, at):
    """' yes', then 'A's (valid) and a stray byte or an unfinished character: either turns the 'A's into U+FFFD
    too, so the text holds 'yes\ufffd' from that token on (read as the text before the run, then the run's
    U+FFFD). After 45 'A's the unfinished <0xC3> was missed before: every tail, begun inside the run, read U+FFFD
    only; the first two guard the fix's reading of a poisoned run."""
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    prompt = [ids["Question:"]]
    tokens = [ids["▁yes"], *row, ids["▁no"]]
    assert _want(tok, prompt, tokens, ["yes\ufffd"]) == at
    assert _checked(tok, prompt, ["yes\ufffd"], tokens) == at


def _checked(tok, prompt: list[int], stop_list: list[str], tokens: list[int]) -> int | None:
    """The token (1-based count) a row appended one at a time, as the decode loop does, ends at."""
    stops = StopStrings(tok, stop_list)
    stops.rows([prompt])
    out: list[int] = []
    for n, t in enumerate(tokens, 1):
        out.append(t)
        if stops(0, out):
            return n
    return None


@pytest.mark.parametrize("prompt_end, row", [([], [0x80, *[0x0A] * 3000]), ([0xE6], [0x0A] * 3000)])
def test_a_poisoned_run_from_the_row_s_first_token_costs_each_token_a_bounded_decoding(tmp_path, prompt_end, row):
    """e608362d's bound left out a run from the row's first token: a row beginning with a stray <0x80>, or after a
    prompt ending in a stray <0xE6>, then newline bytes under --stop '\n\n': the cheap tail matched at every token
    and the exact one walked and decoded the whole row (4,000 ids a token for 4,000 tokens, 8 s)."""
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    counted = _Counting(tok)
    prompt = [ids["Question:"], *prompt_end]
    assert "\n" not in continuation_text(tok, prompt, row)  # (the row has them as U+FFFD)
    assert _checked(counted, prompt, ["\n\n"], row) is None
    assert counted.decoded < 100 * len(row), f"{counted.decoded / len(row):.0f} ids decoded per token"


@pytest.mark.parametrize("stop", [["\n\n"], ["\ufffd yes"], ["\ufffd\n"]])
@pytest.mark.parametrize("run", [[0xE6, *[0x0A] * 3000], list("€".encode()) * 1000])
def test_a_long_byte_run_costs_each_token_a_bounded_decoding_whatever_the_stop_string(tmp_path, monkeypatch, stop,
                                                                                       run):
    """A stop string holding U+FFFD must not bring back the whole run's walk at every token, in a run a stray byte
    poisons (read as the text before the run, then one U+FFFD a byte) or in a valid one (its text is the row's)."""
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    counted = _Counting(tok)
    walks = []  # (row_text.poisoned_run walks the run it is asked about: the exact tail's cost, no decoding)
    monkeypatch.setattr(row_text, "poisoned_run", lambda *a, _walk=row_text.poisoned_run: walks.append(1) or _walk(*a))
    tokens = [ids["Answer:"], *run]
    stops = StopStrings(counted, stop)
    stops.rows([[ids["▁"], ids["Question:"]]])
    out = []
    for t in tokens:
        out.append(t)
        assert not stops(0, out)
    # a tail of a few times the window a token (3-byte characters double it twice); a walk, ~1,500 ids a token
    assert counted.decoded < 400 * len(tokens), f"{counted.decoded / len(tokens):.0f} ids decoded per token"
    assert len(walks) < 50, f"the run walked {len(walks)} times for {len(tokens)} tokens"


def _streamed(tok, stop_list, prompt, row, monkeypatch, capsys):
    """(each step's shown text, all shown, the JSON line's text) of one prompt's row on a terminal."""
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
    output = Output(tok, stop_list, "", 1, len(row), main_rank=True)
    output.file = io.StringIO()
    output.rows([prompt])
    steps, shown, reason, kept = [], "", "length", []
    for t in row:
        kept.append(t)
        output.on_token(0, t)
        shown += capsys.readouterr().err
        steps.append(shown)
        if output.stops is not None and output.stops(0, kept):
            reason = "stop"
            break
    output.write({"text": "p", "ids": prompt}, Result(len(prompt), kept, reason, 1.0, 1.0), speculative=False)
    shown += capsys.readouterr().err
    return steps, shown[:-1], json.loads(output.file.getvalue())["text"]


def test_the_stream_shows_a_prefix_of_the_line_after_any_prompt_ending(tmp_path, monkeypatch, capsys):
    """400 random rows after the prompt endings above (a stray byte among them, the case e608362d fixed for the
    stop strings): the terminal never shows what the JSON line lacks or has as U+FFFD, and ends equal to it."""
    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    special = tok.special_tokens()["</s>"]
    endings = [p for p in _prompts(ids, special) if p]
    rng = random.Random(11901)
    for _ in range(400):
        prompt, row = rng.choice(endings), _row(rng, ids, special)
        stop_list = rng.choice([[], *STOPS])
        steps, shown, text = _streamed(tok, stop_list, prompt, row, monkeypatch, capsys)
        assert all(text.startswith(s) for s in steps), (prompt, row, stop_list, steps[-1], text)
        assert shown == text, (prompt, row, stop_list)
