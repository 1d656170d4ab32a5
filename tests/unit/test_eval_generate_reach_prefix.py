"""`longctx eval --mode generate` reads each prompt after the special tokens its tokenizer puts before a text
(a BOS), so a sequence's answer ends that many positions later than in score mode, which keeps a sequence
`length` tokens (generate_mode.with_prefix). At exactly the trained length with a BOS the answer's last token
ran one position past the model's reach, and no note said so."""

import json

import pytest
from test_eval_prompt_prefix import _bos_tokenizer
from test_tokenizer_follows_model import bpe_tokenizer

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.eval.request import prepare
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TRAINED = 128


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(an hf:DIR trained on TRAINED positions whose tokenizer adds BOS, the same with one adding nothing,
    a text file for filler)."""
    tmp = tmp_path_factory.mktemp("reach")
    model = build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1)
    with_bos, plain = save_hf(model, tmp / "bos"), save_hf(model, tmp / "plain")
    _bos_tokenizer(with_bos / "tokenizer.json")
    bpe_tokenizer(plain / "tokenizer.json")
    for d in (with_bos, plain):
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": TRAINED}))
    text = tmp / "filler.py"
    text.write_text("def f(x):\n    return x + 1\nclass A:\n    pass\n" * 80)
    return with_bos, plain, text


def _notes(checkpoint, text, mode, length=TRAINED):
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{checkpoint}", "--task", "passkey", "--lengths", str(length), "--depths", "0.5",
         "--samples", "1", "--data", str(text), "--mode", mode])
    return [n for n in prepare(args, rest, 1).notes if "positions the model reaches" in n]


def test_generate_mode_counts_the_bos_before_each_prompt(folders):
    with_bos, plain, text = folders
    [note] = _notes(with_bos, text, "generate")
    assert note.startswith(f"length {TRAINED} (after 1 special token) runs past the {TRAINED} positions")
    assert _notes(with_bos, text, "generate", TRAINED - 2) == []


def test_score_mode_and_a_tokenizer_without_specials_are_within_reach(folders):
    with_bos, plain, text = folders
    assert _notes(with_bos, text, "score") == []
    assert _notes(plain, text, "generate") == []
