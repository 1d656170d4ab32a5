"""Where `longctx generate`'s text goes: one JSON line per prompt, the text streamed to a terminal
or a progress bar, and the stop strings that cut it.

Every rank generates the same tokens; only rank 0 writes (the others write to os.devnull, so the
loop is the same on every rank). An --output file is written as FILE.partial and renamed FILE once every
line is in (durable.py publish): a run that stops early leaves FILE.partial with the lines it finished,
never a FILE that reads as complete, and a FILE of an earlier run stays as it was.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import stat
import sys
from pathlib import Path

from .. import strict_json
from ..durable import publish
from ..errors import ConfigError, UserError
from .output_paths import partial_path
from .row_text import CONTEXT_TOKENS, ByteRun, continuation_text, from_character, prompt_context, text_after


class ReaderGone(UserError):
    """stdout's reader closed it (`longctx generate ... | head -n 3`): the run stops, no one being left to read."""

    exit_code = 141  # (128 + SIGPIPE: what the shell reports for a writer a closed pipe ends, `yes | head`)


class StopStrings:
    """Whether a row's text so far contains one of the stop strings, checked on the last tokens only.

    A stop string of c characters that the last token completes starts at most c - 1 characters before
    that token's text, so the tail read must hold that many characters before it. The tail starts at
    4c + 4 tokens (bytes of a UTF-8 character being separate tokens at worst) and doubles until the
    text before its last token holds 4c + 4 characters or it covers the row: tokens that decode to
    nothing (special tokens, which decode skips, or a byte tokenizer's ids >= 256) may lie inside a
    stop string, so a count of tokens alone is not enough. Doubling keeps the work within a few
    decodes of the shortest tail that suffices (one, with one token more, when no token is silent).

    A stop string that is a special token's text (`--stop "<|im_end|>"`, the usual cure for a chat model whose
    EOS leaves out its end of turn) never shows in the text, which decode leaves special tokens out of: it
    ends a row when that token is generated instead (as transformers' stop strings match it). One that holds
    a special token's text among other text could never match, and is refused."""

    def __init__(self, tokenizer, stops: list[str]):
        special = getattr(tokenizer, "special_tokens", dict)()  # {text: id}
        self.stop_ids = {special[s] for s in stops if s in special}
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s not in special]
        for stop in self.stops:
            inside = [t for t in special if t and t in stop]
            if inside:
                raise ConfigError(f"--stop {stop!r} holds the special token {inside[0]!r}, which the generated text "
                                  f"never shows (special tokens decode to nothing), so it could never match; give "
                                  f"--stop {inside[0]!r} on its own (a row then ends when that token is generated).")
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 4
        self.contexts: list = []  # each row's prompt_context (`rows`; None for no prompt): its text is read after it
        self.runs: dict[int, ByteRun] = {}  # the run of byte tokens each row's tokens end in, followed token by token
        self.table = getattr(tokenizer, "fallback_bytes", dict)()  # {id: byte}; {} for other decoders
        # ids that extend a run (byte tokens; special ones, which decode leaves out, join a run)
        self.run_ids = set(self.table) | set(special.values())
        self.fffd = any("\ufffd" in s for s in self.stops)
        self.longest = max((len(s) for s in self.stops), default=0)

    def rows(self, prompts: list, samples: int = 1) -> None:
        """The prompts (their ids) of the rows checked next, prompt-major with `samples` rows each, as the decode
        loop numbers its rows; a speculative prompt is row 0. Each prompt's context is found once here, not at
        every check: prompt_context walks a run of byte tokens the prompt ends in back to its start (a prompt of
        100K byte tokens cost each of a row's first checks that walk, about 70 ms)."""
        contexts = [prompt_context(self.tokenizer, ids) if len(ids) else None for ids in prompts]
        self.contexts = [context for context in contexts for _ in range(samples)]
        self.runs = {}

    def __call__(self, row: int, tokens: list[int]) -> bool:
        if tokens and tokens[-1] in self.stop_ids:
            return True
        if not self.stops:
            return False
        context = self.contexts[row] if row < len(self.contexts) else None
        run = self._run(row, tokens, context)
        if run is not None and run.unreadable():
            # a last token inside a run a stray byte poisons (or that leaves its last character unfinished) adds one
            # U+FFFD (or, special, nothing) to the row's text and turns only the run's earlier characters into
            # U+FFFD: a stop string without one cannot end there, and one with U+FFFD is read on the text before the
            # run, then the run's U+FFFD. Known without the walk over the run that `exact` pays (8,000 such tokens
            # took 15 s of checks, now 0.2 s)
            return self.fffd and self._held_after_run(row, tokens, context)
        start, cheap = self._tail(tokens, context)
        # a match is read again with the byte runs a stray byte poisons as the row reads them (`exact`: a walk
        # over the run, paid only here, not every token of a long run of byte tokens)
        if any(s in cheap for s in self.stops):
            return any(s in self.tail(tokens, context, exact=True) for s in self.stops)
        # the cheap tail reads a run a stray byte poisons, begun before its start, as text where the row has
        # U+FFFD: a stop string holding U+FFFD can lie only there (missed before 2026-12-07). Not where the tail
        # begins inside the run the row ends in, which nothing poisons (_run): its text is the row's
        if not self.fffd or run is not None and start >= run.first:
            return False
        return any(s in self.tail(tokens, context, exact=True) for s in self.stops)

    def _run(self, row: int, tokens: list[int], context) -> ByteRun | None:
        """The run of byte tokens the row's tokens end in (ByteRun); None where the last token is none. Followed for
        the row's own token list, which the decode loop appends to: walked back to its start once, then each token
        feeds its byte to incremental UTF-8 decoders, which raise at a stray byte (never at a character still
        unfinished); a poisoned run stays so as it grows. A run from the row's first token is poisoned by a stray
        byte of its own (a row beginning <0x80> has it as U+FFFD even where the prompt's <0xE6> would complete it:
        text_after then decodes the row alone) or of the run the prompt's last bytes begin (a prompt ending in
        <0xE6>, a row beginning with newline bytes)."""
        n = len(tokens)
        if not self.table or not n or int(tokens[-1]) not in self.run_ids:
            self.runs.pop(row, None)
            return None
        run = self.runs.get(row)
        if run is None or run.tokens is not tokens or run.read > n or \
                not all(int(t) in self.run_ids for t in tokens[run.read:]):
            first = n - 1
            while first > 0 and int(tokens[first - 1]) in self.run_ids:
                first -= 1
            run = self.runs[row] = ByteRun(tokens, first, first, [codecs.getincrementaldecoder("utf-8")()])
            if first == 0 and context and context[0] and int(context[0][-1]) in self.run_ids:
                ids = context[0]  # (the prompt's run, from where prompt_context begins it: a character or its start)
                k = len(ids)
                while k > 0 and int(ids[k - 1]) in self.run_ids:
                    k -= 1
                run.decoders.append(codecs.getincrementaldecoder("utf-8")())
                run.poisoned = self._poisoned_by(run.decoders[1:], [int(t) for t in ids[k:]])
        run.poisoned = run.poisoned or self._poisoned_by(run.decoders, tokens[run.read:])
        run.bytes += sum(int(t) in self.table for t in tokens[run.read:])
        run.read = n
        return run

    def _poisoned_by(self, decoders: list, ids) -> bool:
        """Whether the bytes of `ids` make any of `decoders` (fed the run's bytes so far) meet a stray byte."""
        new = bytes(self.table[int(t)] for t in ids if int(t) in self.table)
        try:
            for decoder in decoders:
                decoder.decode(new)
        except UnicodeDecodeError:
            return True
        return False

    def _held_after_run(self, row: int, tokens: list[int], context) -> bool:
        """Whether the row's text holds a stop string where its tokens end in a poisoned run (_run): its text is the
        text before the run (read once a run: it stays as the run grows), then one U+FFFD a byte of the run."""
        run = self.runs[row]
        if run.before is None:
            run.before = self.tail(tokens[:run.first], context, exact=True)
        text = run.before + "\ufffd" * min(run.bytes, self.longest)
        return any(s in text for s in self.stops)

    def tail(self, tokens: list[int], context=None, exact: bool = False) -> str:
        """The text of the last tokens of `tokens`, enough of them to hold any stop string the last one ends;
        where that is the whole row, as it reads after its prompt's `context` (prompt_context's; text_after).
        `exact`: begun where the row's decoding reads a character from, in a run of byte tokens too
        (from_character)."""
        return self._tail(tokens, context, exact)[1]

    def _tail(self, tokens: list[int], context=None, exact: bool = False) -> tuple[int, str]:
        """(the token `tail`'s text begins at, the text)."""
        n, last = self.window, None
        while True:
            if n >= len(tokens) and context:
                return 0, text_after(self.tokenizer, context, tokens)
            # (begun on a character, not inside one: see from_character)
            start, text = from_character(self.tokenizer, tokens, max(0, len(tokens) - n), len(tokens), exact)
            if context and (start == 0 or exact and self._joins_prompt_run(context, tokens, start)):
                # (a run of byte tokens back to the row's start, or one the prompt's last bytes begin, which may
                # poison it for the row's decoding though its own bytes are valid: as the line reads it)
                return 0, text_after(self.tokenizer, context, tokens)
            if n >= len(tokens):
                return start, text
            if last is None:  # (the last token's own text: the characters before it are what counts)
                last = len(self.tokenizer.decode(tokens[-1:]))
            if len(text) - last >= self.window:
                return start, text
            n *= 2

    def _joins_prompt_run(self, context, tokens: list[int], start: int) -> bool:
        """Whether tokens[start] lies in a run of byte tokens that begins in the prompt (its context's last id one):
        a prompt ending in a stray <0xE6> has the row's first bytes, valid on their own, as U+FFFD."""
        ids = context[0]
        return bool(ids) and int(ids[-1]) in self.run_ids and all(int(t) in self.run_ids for t in tokens[:start + 1])

    def cut(self, text: str) -> str:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[:min(found)] if found else text


class Stream:
    """One prompt's text, printed to stderr as it grows. What is shown is always a prefix of the text
    the JSON line will hold: nothing at or after a stop string that the text contains, nothing of a
    tail that could still become one (a suffix of the text that a stop string starts with), no partial
    UTF-8 character, and nothing of an open run of byte-fallback tokens (_open_run). So the terminal never
    shows a character the JSON output removes, whether the stop string spans tokens or sits inside one,
    and whatever order the engine checks it in.

    Each token costs the same whatever the length: only the tokens after the last settled one are
    decoded, after a few settled ones for context (a SentencePiece decoder drops the first space of a
    decoding: '▁time' alone is 'time'), and only the text not yet shown is kept and searched. A stop
    string cannot begin in the shown text (safe_end held back every tail one could begin). When the
    context's text is not a prefix of the longer decoding (a character across the boundary), the
    row's text is decoded as the line reads it (text_after: the new ids alone where the prompt's text is no prefix
    of the whole; the whole decoding, cut at the prompt's length, showed other characters before 2026-12-07)."""

    def __init__(self, tokenizer, stops: list[str], prompt_ids=()):
        self.tokenizer, self.tokens, self.shown = tokenizer, [], 0
        self.stops = [s for s in stops if s]
        self.settled = 0  # tokens whose text is final: it is self.unshown's prefix, or shown already
        self.base, self.unshown = 0, ""  # the settled text from character `base` on (base <= shown)
        self.origin = 0  # where the continuation's text begins: after the prompt's last ids, not shown
        self.context, self.head = 0, ""  # how many of self.tokens are the prompt's (prompt_context's ids), their text
        self.bytes = getattr(tokenizer, "fallback_bytes", dict)()  # {id: byte} of a ByteFallback decoder's tokens
        self.silent = set(getattr(tokenizer, "special_tokens", dict)().values())
        self.run_from, self.length = None, 0  # (_open_run) an open byte run's start, not shown; the text's length
        if prompt_ids:  # (the text as it reads after the prompt, continuation_text's: its first space kept)
            self.tokens, self.head = prompt_context(tokenizer, prompt_ids)
            self.settled = self.context = len(self.tokens)
            self.shown = self.base = self.origin = self.length = len(self.head)

    def __call__(self, row: int, token: int) -> None:
        self.tokens.append(token)
        if self._open_run(token):  # (a run begun before goes on: nothing more shows, nothing is decoded)
            return
        text = self._text_from_base()
        self.length = self.base + len(text)
        end = len(text)
        start = self.shown - self.base
        while end > start and text[end - 1] == "\ufffd":  # (a partial character, before stop strings are
            end -= 1                                       # matched: it would end a tail one begins with)
        end = end if self.run_from is None else max(start, min(end, self.run_from - self.base))
        end = safe_end(text, self.stops, start, end)
        if end > start:
            sys.stderr.write(text[start:end])
            sys.stderr.flush()
            self.shown = self.base + end
        if not text.endswith("\ufffd"):  # every character final: the tokens so far are settled
            self.settled, self.unshown, self.base = len(self.tokens), text[end:], self.base + end
        else:
            drop = max(0, min(end, len(self.unshown)))  # (the settled text shown now is not kept)
            self.unshown, self.base = self.unshown[drop:], self.base + drop

    def _open_run(self, token: int) -> bool:
        """`run_from`: where (as `base` counts) the run of a ByteFallback decoder's byte tokens that the tokens end
        with begins (special tokens, which decode leaves out, join it); None for none. Its characters are not
        final: a stray byte after them makes the decoder write the whole run as U+FFFD (from_character). True
        where `token` goes on a run begun before it: nothing past the run's start shows until it ends, and the text
        before it showed at its first token, so nothing is decoded (a partial character's bytes decode as U+FFFD, no
        prefix of the settled text: the whole row was decoded for each such token, O(n) a token)."""
        going_on = self.run_from is not None and (token in self.bytes or token in self.silent)
        if token in self.bytes:
            self.run_from = self.length if self.run_from is None else self.run_from
        elif token not in self.silent:
            self.run_from = None
        return going_on

    def _text_from_base(self) -> str:
        """The text of all tokens so far, from character `base` on."""
        first = self.settled - CONTEXT_TOKENS
        # (not inside the prompt's ids: prompt_context begins them where the line's decoding reads them from, which
        # may be further back, at a run of byte tokens a stray byte poisons)
        first = 0 if first < self.context else first
        start, head = from_character(self.tokenizer, self.tokens, first, self.settled)
        context = self.tokens[start:self.settled]
        whole = self.tokenizer.decode([*context, *self.tokens[self.settled:]])
        if whole.startswith(head):
            return self.unshown + whole[len(head):]
        return text_after(self.tokenizer, (self.tokens[:self.context], self.head),  # (as the line reads it: see
                          self.tokens[self.context:])[self.base - self.origin:]  # the class docstring)

    def finish(self, text: str) -> None:
        sys.stderr.write(text[self.shown - self.origin:] + "\n")
        sys.stderr.flush()


def safe_end(text: str, stops: list[str], start: int = 0, end: int | None = None) -> int:
    """How much of `text[:end]` can be shown for sure: up to the first stop string it contains from
    `start` on (the engine ends the row on this token, and the JSON text is cut there), else up to the
    longest tail of it that a stop string begins with (more tokens may complete that one). An index into
    `text`; `start` is what is shown already, where no stop string can begin (see below).

    Why this is enough: a stop string s found later at i either ran past the end of the text, so
    text[i:end] is a tail that s begins with and the returned end stays before i, or lay whole in
    it, and then the row ended here."""
    end = len(text) if end is None else end
    found = [i for i in (text.find(s, start, end) for s in stops) if i >= 0]
    if found:
        return min(found)
    safe = end
    for s in stops:
        for n in range(min(len(s) - 1, end - start), 0, -1):  # the longest proper prefix of s the text ends with
            if text.endswith(s[:n], start, end):
                safe = min(safe, end - n)
                break
    return safe


class Output:
    """This rank's output: the JSON lines file, the stop strings, and the stream or the bar."""

    def __init__(self, tokenizer, stops: list[str], path: str, prompts: int, new_tokens: int, main_rank: bool,
                 echo: bool = False):
        from ..progress import on_terminal, progress_bar

        self.tokenizer, self.echo = tokenizer, echo
        self.stops = StopStrings(tokenizer, stops) if stops else None
        self.path, self.lines, self.mode = path if main_rank else "", 0, None  # (mode: _keep_mode)
        self.partial = partial_path(self.path) if self.path else ""
        if self.partial != self.path:  # (a link is followed, as open() does: the rename replaces its file, not it)
            self.path = os.path.realpath(self.path)
            self.partial = partial_path(self.path)
        if not main_rank:  # the same tokens on every rank: rank 0 speaks
            self.file = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
        else:
            self.file = open(self.partial, "w", encoding="utf-8") if path else sys.stdout  # noqa: SIM115
            self._keep_mode()
        # one prompt on a terminal streams its text; several show a bar of new tokens
        self.text_stops = self.stops.stops if self.stops is not None else []  # (a special token's never shows)
        self.stream = Stream(tokenizer, self.text_stops) if main_rank and prompts == 1 and on_terminal() else None
        self.bar = None if self.stream else progress_bar(new_tokens, "generate", "tok", main_rank)

    def rows(self, prompts: list, samples: int = 1) -> None:
        """The prompts (their ids) generated next, `samples` rows each: each row's text is read after its
        prompt's last ids, by the stop strings and the stream alike (StopStrings.rows)."""
        if self.stops is not None:
            self.stops.rows(prompts, samples)
        if self.stream is not None and prompts:
            self.stream = Stream(self.tokenizer, self.text_stops, prompts[0])

    def _keep_mode(self) -> None:
        """The file FILE.partial replaces keeps its permissions, as a write in place kept them (a private 0600
        output was published 0644 by the rename): FILE.partial has them while written (writable by its owner, so
        a read-only FILE's leaves no FILE.partial the next run cannot open), FILE exactly them (close)."""
        if self.partial != self.path and os.path.isfile(self.path):
            self.mode = stat.S_IMODE(os.stat(self.path).st_mode)
            os.fchmod(self.file.fileno(), self.mode | stat.S_IWUSR)

    def on_token(self, row: int, token: int) -> None:
        if self.stream is not None:
            self.stream(row, token)
        elif self.bar is not None:
            self.bar.update(1)

    def write(self, prompt: dict, result, speculative: bool, samples: int = 1) -> None:
        """One prompt's JSON line (its text cut at a stop string), and the stream or bar finished for it.
        With `samples` > 1 (--num-samples), one line per sample, its index under "sample"; when sampling,
        "seed" is the seed its draws came from (generate/sampling.py); with --logprobs, "logprobs" (each
        new token's) and, for N > 0, "top_logprobs" (per new token, [[id, logprob], ...] most likely
        first)."""
        # the text as it reads after the prompt (decoded after its last ids: a SentencePiece decoder's first space
        # kept, as transformers' pipeline and vLLM give it), the one the stop strings were checked on
        text = continuation_text(self.tokenizer, prompt.get("ids", []), result.tokens)
        if self.stops is not None and result.finish_reason == "stop":
            text = self.stops.cut(text)
        if self.stream is not None:
            self.stream.finish(text)
        line = {**({"id": prompt["id"]} if "id" in prompt else {}), "prompt_tokens": result.prompt_tokens,
                "tokens": result.tokens, "text": prompt["text"] + text if self.echo else text,
                "finish_reason": result.finish_reason,
                "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
                "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
                **({"tau": round(result.tau, 3), "target_passes": result.passes} if speculative else {})}
        if samples > 1:
            line["sample"] = result.sample
        for key in ("seed", "logprobs", "top_logprobs", "compile_recompiles"):
            if getattr(result, key, None) is not None:
                line[key] = getattr(result, key)
        if self.stream is None and self.bar is not None and speculative:  # (speculation calls no on_token)
            self.bar.update(len(result.tokens))
        self._to_file(_one_line(strict_json.dumps(line, ensure_ascii=False)) + "\n")
        self.lines += 1

    def flush(self) -> None:
        """The lines so far out of the buffer (each batch's, so a run stopped later keeps them)."""
        self._to_file("", flush=True)

    def _to_file(self, text: str, flush: bool = False) -> None:
        """`text` written (and flushed); a reader that closed stdout (a pipe to `head`) is ReaderGone, one line on
        stderr, where it was a BrokenPipeError traceback (and the prompts after it generated for no one)."""
        try:
            self.file.write(text)
            if flush:
                self.file.flush()
        except BrokenPipeError:
            if self.file is sys.stdout:
                # (stdout's buffered lines would raise again when the interpreter flushes it at exit)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            elif self.partial == self.path:  # (--output /dev/stdout or a named pipe, written where it is)
                with contextlib.suppress(OSError):  # (its buffered lines raise again as it closes: closed still)
                    self.file.close()
                self.file = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (close() closes it)
            else:
                raise
            said = "stdout" if self.file is sys.stdout or not self.path else f"--output {self.path}"
            # (an --output that is a pipe itself, /dev/stdout or a named pipe: the cure is a regular file, not --output)
            which = "" if said == "stdout" else " (a regular file, not a pipe)"
            raise ReaderGone(f"{said} was closed by its reader (a pipe to `head`, say) with {self.lines} line(s) "
                             f"written: generation stopped. Pass --output FILE{which} to keep every line.") from None

    def close(self, complete: bool = True) -> None:
        """Close the output; an --output file is published under its name only when `complete` (every line
        written), else its lines so far stay in FILE.partial, said on stderr."""
        if self.bar is not None:
            self.bar.close()
        if self.file is not sys.stdout:
            self.file.close()
        if self.partial == self.path:  # (stdout, another rank's, or a device such as /dev/null: written as it came)
            return
        if complete:
            if self.mode is not None:
                os.chmod(self.partial, self.mode)
            publish(Path(self.partial), Path(self.path))
        else:
            sys.stderr.write(f"generate: stopped before every prompt was done: {self.path} was not written; the "
                             f"{self.lines} line(s) finished are in {self.partial}\n")

    def __enter__(self) -> Output:
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.close(complete=kind is None)


# characters JSON leaves raw in a string that Python's str.splitlines() (and editors) take for line ends: a line whose
# text held one read as two halves, neither of them JSON, to `f.read().splitlines()`. Escaped, the line reads the same.
_LINE_ENDS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _one_line(dumped: str) -> str:
    """A JSON line (json.dumps' output, whose structure is ASCII) with _LINE_ENDS escaped inside its strings."""
    for raw, escaped in _LINE_ENDS.items():
        if raw in dumped:
            dumped = dumped.replace(raw, escaped)
    return dumped
