"""`longctx eval` on a checkpoint whose own tokenizer has ids past its vocabulary (hf:DIR's tokenizer.json with
tokens added after the embedding was sized): the refusal said to pass the tokenizer the model was trained with
(--tokenizer), and every other --tokenizer was then refused as not the weights' own, a loop with no way out. It
now says the checkpoint's two files disagree. A --tokenizer taken unchecked (the weights name none) keeps the
advice to pass the right one."""

import pytest
from test_tokenizer_follows_model import bpe_tokenizer
from tokenizers import Tokenizer

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.errors import ConfigError, DataError
from longctx.eval.request import prepare
from longctx.models.hf import save_hf
from longctx.models.llama import build_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(an hf:DIR of vocab_size 300 whose tokenizer.json has 337 tokens, the same without it, that tokenizer,
    a text file)."""
    tmp = tmp_path_factory.mktemp("vocab")
    model = build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=300"]).model, seed=1)
    own, bare = save_hf(model, tmp / "own"), save_hf(model, tmp / "bare")
    tok = Tokenizer.from_file(str(bpe_tokenizer(tmp / "tokenizer.json")))
    tok.add_special_tokens([f"<x{i}>" for i in range(40)])
    tok.save(str(own / "tokenizer.json"))
    text = tmp / "filler.py"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    return own, bare, text


def _prepare(checkpoint, text, *extra):
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{checkpoint}", "--task", "ppl", "--lengths", "64", "--data", str(text), *extra])
    return prepare(args, rest, 1)


def test_the_checkpoints_own_tokenizer_past_its_vocabulary_says_the_two_disagree(folder):
    own, _, text = folder
    with pytest.raises(DataError, match=r"its own tokenizer .* has 337 tokens but its config.json's vocab_size .* "
                                        r"is 300: the checkpoint's tokenizer and weights disagree") as e:
        _prepare(own, text)
    assert "pass the tokenizer the model was trained with" not in str(e.value)
    with pytest.raises(DataError, match="tokenizer and weights disagree"):  # (the same file given: the same)
        _prepare(own, text, "--tokenizer", str(own / "tokenizer.json"))


def test_an_unchecked_tokenizer_past_the_vocabulary_is_told_to_pass_the_models(folder):
    own, bare, text = folder
    with pytest.raises(DataError, match=r"has 337 tokens but the model's vocabulary is 300; pass the tokenizer"):
        _prepare(bare, text, "--tokenizer", str(own / "tokenizer.json"))


def _prepare_generate(checkpoint, *extra):
    from longctx.generate.cli import prepare as prepare_generate

    args, rest = build_parser("generate").parse_known_args(
        ["generate", "--checkpoint", f"hf:{checkpoint}", "--prompt", "def f(x):", *extra])
    return prepare_generate(args, rest)


def test_generate_says_the_checkpoints_two_files_disagree_as_eval_does(folder):
    """generate's refusal advised --tokenizer too, which was then refused as not the weights' own (the same loop);
    it now says eval's words (config/tokenizer.py vocab_refusal, shared), naming the flag the user typed."""
    own, bare, _ = folder
    for extra in ([], ["--tokenizer", str(own / "tokenizer.json")]):
        with pytest.raises(ConfigError, match=rf"--checkpoint hf:{own}: its own tokenizer .* has 337 tokens but its "
                                              r"config.json's vocab_size .* is 300: the checkpoint's tokenizer and "
                                              r"weights disagree") as e:
            _prepare_generate(own, *extra)
        assert "pass the tokenizer the model was trained with" not in str(e.value)
    with pytest.raises(ConfigError, match=r"has 337 tokens but the model's vocabulary is 300; pass the tokenizer"):
        _prepare_generate(bare, "--tokenizer", str(own / "tokenizer.json"))  # (taken unchecked: may be another)
