"""Audit of `longctx eval`'s inputs: bad flags refused before work with a clear error, and retrieval prompts
built from as much filler as their length needs (checked against the source text itself)."""

import numpy as np
import pytest

import longctx.eval.tasks as tasks
from longctx.cli import build_parser
from longctx.config import load_config
from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import ConfigError
from longctx.eval.request import prepare
from longctx.eval.tasks import TokenSource, retrieval_sequences
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TOK = ByteTokenizer()
TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(an hf:DIR of a random one-layer model, a text file for filler)."""
    tmp = tmp_path_factory.mktemp("evalaudit")
    hf = save_hf(build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1),
                 tmp / "hf")
    text = tmp / "filler.py"
    text.write_text(TEXT)
    return hf, text


def _prepare(folder, *extra):
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--lengths", "384", "--samples", "1",
         "--data", str(text), *extra])
    return prepare(args, rest, 1)


@pytest.mark.parametrize("extra", [("--task", "passkey"), ("--task", "needle", "--mode", "generate")])
def test_a_negative_seed_is_refused_with_a_clear_error(folder, extra):
    """--seed -1 stopped the command with numpy's bare `ValueError: expected non-negative integer` (the
    prompts' draws are seeded from [seed, length, sample]); it is a ConfigError naming the flag."""
    with pytest.raises(ConfigError, match="--seed"):
        _prepare(folder, *extra, "--seed", "-1")
    assert _prepare(folder, *extra, "--seed", "0").sequences[384]  # zero and up still run


def test_a_length_past_the_filler_pool_draws_from_the_whole_source(monkeypatch):
    """Filler came from the first FILLER_POOL_TOKENS (4M) tokens of the source only, so a length past it was
    refused although the source held enough ('needs at least 8388608 filler tokens; ... has 4194304').
    Shrunk here to 200 tokens: a 512-token prompt from a 3,000-token source is built, and its filler is
    one stretch of the source's text (the needle, the question and the answer taken out)."""
    monkeypatch.setattr(tasks, "FILLER_POOL_TOKENS", 200)
    source_tokens = TOK.encode(TEXT).astype(np.int64)
    assert len(source_tokens) > 512 * 2
    src = TokenSource(lambda: iter([source_tokens]), "filler")
    seqs = retrieval_sequences("passkey", src, TOK, 512, [0.0, 0.5, 1.0], 2, seed=3)
    assert len(seqs) == 6
    for q in seqs:
        assert len(q.tokens) == 512
        text = TOK.decode(q.tokens)
        needle = f" The pass key is {q.answer}. Remember it. {q.answer} is the pass key. "
        tail = f"\nWhat is the pass key? The pass key is {q.answer}"
        assert text.count(needle) == 1 and text.endswith(tail)
        before, after = text[:-len(tail)].split(needle)
        assert (before + after) in TEXT  # the filler is one contiguous stretch of the source
        filler = len(before + after)
        # the needle at its depth, moved back at most 1/32 of the filler to a line's or a word's start
        assert 0 <= q.depth * filler - len(before) <= filler // 32 + 1
        assert before == "" or before[-1].isspace() or after[:1].isspace() or len(before) == round(q.depth * filler)


def _legacy_llama_tokenizer(folder):
    """A Llama-2 / Mistral-style tokenizer.json as those models ship it: Prepend('▁') in the normalizer, no
    pre-tokenizer, and pieces that only begin with '▁' (SentencePiece splits words before merging: trained
    here with a Metaspace pre-tokenizer, then left without one, as the converted files are)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    folder.mkdir()
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=[chr(c) for c in range(32, 127)] + ["▁"])
    tok.train_from_iterator(["The pass key is 7 1 4 3 2. Remember it. What is the pass key? def f(x): return x\n"
                             "The special magic number for apple is: 1234567."] * 20, trainer)
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_pieces_read_as_inside_the_text_with_a_prepending_tokenizer(tmp_path, task):
    """The needle, question and answer are spliced between filler: each is encoded as it reads inside the
    whole text, so the answer's ids are the ones that follow the question when the tokenizer reads
    question + answer as one text (the model's view), and the prompt has no stray word boundaries.
    Encoded alone under a Prepend('▁') normalizer, each piece gained a '▁': 'is  86556'."""
    from longctx.data.synthetic import retrieval_prompt
    from longctx.data.tokenizer import HFTokenizer

    tok = HFTokenizer(_legacy_llama_tokenizer(tmp_path / "sp"))
    filler = tok.encode_batch(["def f(x): return x\n" * 200])[0].astype(np.int64)
    p = retrieval_prompt(task, filler, 300, 0.5, np.random.default_rng(0), tok)
    text = tok.decode(p.tokens)
    assert "is  " not in text and "is:  " not in text, text  # (the answer's single space stays single)
    from longctx.data.synthetic import _encode

    for piece in (" The pass key is 86556. Remember it. ", "\nWhat is the pass key? The pass key is", " 86556."):
        context = "def f(x): return x"  # (a piece after text that ends a word reads as in the whole text)
        ids = [int(t) for t in tok.encode_batch([context + piece])[0]]
        assert ids == [*tok.encode_batch([context])[0], *_encode(tok, piece)], piece
    whole = [int(t) for t in tok.encode_batch([text[text.rindex("\n"):]])[0]]
    answer = [int(t) for t in p.tokens[p.answer_start:]]
    assert whole[-len(answer):] == answer and text.endswith(" " + p.answer), text[-60:]


def test_ppl_with_fewer_spans_than_asked_says_so(folder):
    """--samples 20 where the text holds fewer 384-token spans: the result's loss is over those alone,
    and a note says how many (nothing said before); as many as asked: no note."""
    short = _prepare(folder, "--task", "ppl", "--samples", "20")
    held = len(short.sequences[384])
    assert 0 < held < 20 and held == len(TOK.encode(TEXT)) // 384
    assert any(f"ppl at 384 tokens: {held} spans of the 20 asked for" in n for n in short.notes), short.notes
    assert not any("asked for" in n for n in _prepare(folder, "--task", "ppl", "--samples", "1").notes)
