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
        assert abs(len(before) - q.depth * len(before + after)) <= 1  # the needle at its depth
