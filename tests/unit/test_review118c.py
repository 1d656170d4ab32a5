"""Review of 78064e97 and e00772b4: tokenizer_digest parsed a tokenizer.json holding two end-of-document candidates
(Llama-3's) at every call, about a second for 14 MB, several calls a run; a merge of scans made before the EOS rule
said their tokenizer file had changed and to restore it. The terminal stream against the JSON line and the engine's
stop, randomized (the early return inside a byte run)."""

import hashlib
import io
import json
import random
import sys

import pytest

import longctx.data.tokenizer as tokenizer_module
import longctx.progress
from longctx.data.tokenizer import HFTokenizer, tokenizer_digest
from longctx.errors import DataError
from longctx.generate.output import Output, StopStrings, continuation_text
from longctx.generate.results import Result


def _word_and_special(path, extra: str = "c") -> None:
    """A tokenizer.json whose vocabulary has '<|endoftext|>' as a plain word and '</s>' as its special token: the
    EOS rule of 7f273663 chooses another token than before (`extra`: a word that makes the file's bytes new)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    lib = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1, "a": 2, "b": 3, "</s>": 4, extra: 5},
                                     unk_token="[UNK]"))
    lib.pre_tokenizer = pre_tokenizers.Whitespace()
    lib.add_special_tokens(["</s>"])
    path.mkdir(parents=True, exist_ok=True)
    lib.save(str(path / "tokenizer.json"))


def test_a_tokenizer_json_holding_two_candidates_is_parsed_once_for_its_digests(tmp_path, monkeypatch):
    """Every tokenizer_digest call parsed the file (1.1 s for a 14 MB tokenizer.json): a run asks for it per stage's
    store, in the preflight and again in the run, and a build two or three times."""
    _word_and_special(tmp_path / "t", extra=f"w{random.random()}")  # (content no earlier test digested)
    parsed = []
    real = tokenizer_module.Tokenizer

    class Counting:
        @staticmethod
        def from_file(path):
            parsed.append(path)
            return real.from_file(path)

    monkeypatch.setattr(tokenizer_module, "Tokenizer", Counting)
    digests = {tokenizer_digest(str(tmp_path / "t")) for _ in range(3)}
    assert len(digests) == 1
    assert digests != {hashlib.sha256((tmp_path / "t" / "tokenizer.json").read_bytes()).hexdigest()}  # (the choice)
    assert len(parsed) <= 1, f"tokenizer.json parsed {len(parsed)} times for 3 digests of the same file"


def test_a_remembered_digest_still_follows_the_config_s_eos_token(tmp_path):
    """The parse is remembered per content and configured eos_token: an edit of tokenizer_config.json's eos_token
    (where no candidate is in the vocabulary) still gives another digest in the same process."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    lib = Tokenizer(models.WordLevel({"[UNK]": 0, "<end>": 1, "<stop>": 2, "a": 3}, unk_token="[UNK]"))
    lib.pre_tokenizer = pre_tokenizers.Whitespace()
    lib.save(str(tmp_path / "tokenizer.json"))
    digests = []
    for eos in ("<end>", "<stop>", "<end>"):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        digests.append(tokenizer_digest(str(tmp_path)))
    assert digests[0] != digests[1] and digests[0] == digests[2]


def test_a_merge_of_scans_made_before_the_eos_rule_says_why(tmp_path):
    """Scans made before e00772b4 recorded the file's sha256 alone; their documents end with the plain word. The
    merge's refusal said the file had changed since and to restore it: it had not, and restoring cures nothing."""
    from test_data_build import opts, quiet

    from longctx.data.builder.pipeline import build_store, merge_scans

    _word_and_special(tmp_path / "t")
    assert HFTokenizer(tmp_path / "t" / "tokenizer.json").eos_id == 4
    (tmp_path / "in").mkdir()
    for i in range(4):
        (tmp_path / "in" / f"d{i}.txt").write_text("a b " * (5 + i))
    scans = []
    for i in range(2):
        out = tmp_path / f"scan{i}"
        build_store(opts([tmp_path / "in"], out, 32, tokenizer=str(tmp_path / "t"), strategy="bfd", dedup="none",
                         eval_fraction=0.0, shard=(i, 2)), log=quiet)
        plan = next(out.rglob("plan.json"))
        p = json.loads(plan.read_text())
        p["tokenizer_digest"] = hashlib.sha256((tmp_path / "t" / "tokenizer.json").read_bytes()).hexdigest()
        plan.write_text(json.dumps(p))  # (as the version before e00772b4 recorded it)
        scans.append(str(out))
    with pytest.raises(DataError) as e:
        merge_scans(scans, str(tmp_path / "m"), progress=False, log=quiet)
    assert "end-of-document token" in str(e.value), str(e.value)


class _Stderr:
    def __init__(self):
        self.text = io.StringIO()

    def write(self, s):
        self.text.write(s)

    def flush(self):
        pass


def _llama_like(tmp_path) -> HFTokenizer:
    """<0x00>..<0xFF> byte pieces, a ByteFallback decoder, special tokens <s>, </s> and <x> (one inside a run)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "hello": 5, "<x>": 262, "b": 263, "é": 264}
    vocab.update({f"<0x{b:02X}>": 6 + b for b in range(256)})
    lib = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    lib.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    lib.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    lib.add_special_tokens(["<s>", "</s>", "<x>"])
    lib.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(tmp_path / "tokenizer.json")


_WORDS = [3, 4, 5, 263, 264]  # (_llama_like's ids of plain words)


def _ids(rng, n: int) -> list[int]:
    """Words, whole characters as byte tokens, stray bytes and a special token among them."""
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.4:
            out += [6 + b for b in rng.choice("aé中ᚠ").encode()]
        elif r < 0.5:
            out.append(6 + rng.choice([0xC3, 0xA9, 0xE4, 0x41, 0x0A]))
        elif r < 0.6:
            out.append(262)
        else:
            out.append(rng.choice(_WORDS))
    return out[:n]


def test_the_stream_against_the_line_and_the_engine_s_stop_randomized(tmp_path, monkeypatch):
    """400 rows: a prompt and new ids of runs of byte tokens (poisoned or not, a special token inside), stop strings
    inside, across and right after a run; the row ends where StopStrings ends it. After every token the terminal
    shows a prefix of the JSON line's text, and all of it once the row is written (a run's tokens return early); without
    stop strings, all the text so far after each word (a run closed by it shows then)."""
    monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
    tok = _llama_like(tmp_path)
    for seed in range(400):
        rng = random.Random(seed)
        prompt, new = [1, *_ids(rng, rng.randint(0, 6))], _ids(rng, rng.randint(1, 25))
        stops = rng.choice([[], ["a"], ["é"], ["中a"], ["o中"], ["\ufffd"], ["ᚠ ", " a"], ["lo"], ["aé"]])
        check = StopStrings(tok, stops) if stops else None
        if check is not None:
            check.rows([prompt])
        tokens, reason = [], "length"
        for t in new:
            tokens.append(t)
            if check is not None and check(0, tokens):
                reason = "stop"
                break
        err = _Stderr()
        monkeypatch.setattr(sys, "stderr", err)
        output = Output(tok, stops, "", 1, len(tokens), main_rank=True)
        output.file = io.StringIO()
        output.rows([prompt])
        steps = []
        for t in tokens:
            output.on_token(0, t)
            steps.append(err.text.getvalue())
        output.write({"text": "p", "ids": prompt}, Result(len(prompt), tokens, reason, 1.0, 1.0), speculative=False)
        monkeypatch.undo()
        monkeypatch.setattr(longctx.progress, "on_terminal", lambda: True)
        text = json.loads(output.file.getvalue())["text"]
        case = f"seed {seed}: prompt {prompt}, tokens {tokens}, stops {stops}"
        assert all(text.startswith(s) for s in steps), f"{case}: showed {steps[-1]!r}, the line {text!r}"
        assert err.text.getvalue() == text + "\n", case
        for k, t in enumerate(tokens):  # (no stop string to hold a tail back: a word closes any run, all shows)
            if not stops and t in _WORDS:
                assert steps[k] == continuation_text(tok, prompt, tokens[:k + 1]), f"{case}: after token {k}"
