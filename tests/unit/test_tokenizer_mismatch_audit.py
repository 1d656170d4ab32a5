"""`longctx generate` and `longctx eval` read text with the tokenizer the checkpoint's weights were trained
with (config/tokenizer.py checkpoint_tokenizer). Before this audit both took any --tokenizer without a
word: `--tokenizer byte` on a BPE-trained Hugging Face model, or a tokenizer.json on a byte-trained
checkpoint, fed the model ids that mean other text, and it wrote garbage with no error. Now a tokenizer
that is not the weights' own (compared by content) is one error before any weight is read, naming both
and the fix; the same tokenizer at another path (a copy, or the recorded file moved) is taken; weights
that name no tokenizer take --tokenizer with a note; and generate refuses a tokenizer larger than the
model's embedding even when the prompt's ids happen to fit (eval already did: pinned here too)."""

import shutil

import pytest

transformers = pytest.importorskip("transformers")
from test_export_audit import checkpoint  # noqa: E402  (a 1-step, 1-layer longctx checkpoint, vocab 320)
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.cli import build_parser  # noqa: E402
from longctx.errors import UserError  # noqa: E402

TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 80


@pytest.fixture(scope="module")
def hf_bpe(tmp_path_factory):
    """A tiny Llama saved by transformers, with the BPE tokenizer.json it was (notionally) trained with."""
    d = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    bpe_tokenizer(d / "tokenizer.json")
    (d / "text.txt").write_text(TEXT)
    return d


def _generate(ck, *argv):
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", str(ck), "--prompt", "x",
                                                            "--max-new-tokens", "2", *argv])
    return prepare(args, rest)


def _eval(ck, text, *argv):
    from longctx.eval.request import prepare

    args, rest = build_parser("eval").parse_known_args(["eval", "--checkpoint", str(ck), "--task", "ppl", "--lengths",
                                                        "128", "--samples", "1", "--data", str(text), *argv])
    return prepare(args, rest, 1)


def _mismatches(tmp_path, hf_bpe):
    """(checkpoint, the tokenizer its weights were trained with, another one given)."""
    own = str((hf_bpe / "tokenizer.json").resolve())
    other = str(bpe_tokenizer(tmp_path / "other.json", vocab_size=280))
    byte_ck = checkpoint(tmp_path, "byte")
    return [(f"hf:{hf_bpe}", own, "byte"), (f"hf:{hf_bpe}", own, other), (byte_ck, "byte", own)]


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_tokenizer_that_is_not_the_weights_own_is_refused_naming_both_and_the_fix(tmp_path, hf_bpe, command):
    for ck, own, given in _mismatches(tmp_path, hf_bpe):
        with pytest.raises(UserError) as e:  # (before: prepared without a word, every id read as other text)
            if command == "generate":
                _generate(ck, "--tokenizer", given)
            else:
                _eval(ck, hf_bpe / "text.txt", "--tokenizer", given)
        msg = " ".join(str(e.value).split())
        assert f"--tokenizer {given} is not the tokenizer" in msg and f"({own})" in msg, msg
        assert "Drop --tokenizer" in msg and f"pass --tokenizer {own}" in msg, msg


def test_the_same_tokenizer_at_another_path_is_taken(tmp_path, hf_bpe):
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(hf_bpe / "tokenizer.json", copy)
    bpe = bpe_tokenizer(tmp_path / "bpe.json")  # the same bytes as hf_bpe's (a deterministic training)
    assert bpe.read_bytes() == (hf_bpe / "tokenizer.json").read_bytes()
    for given in (hf_bpe / "tokenizer.json", hf_bpe, copy, copy.parent):
        request = _generate(f"hf:{hf_bpe}", "--tokenizer", str(given))
        assert request.tokenizer_spec == str(given) and not any("--tokenizer" in n for n in request.notes)
        assert _eval(f"hf:{hf_bpe}", hf_bpe / "text.txt", "--tokenizer", str(given)).tokenizer == str(given)
    byte_ck = checkpoint(tmp_path, "byte")
    assert _generate(byte_ck, "--tokenizer", "byte").prompts[0]["ids"] == [ord("x")]
    # a checkpoint trained with a tokenizer.json that has since moved: its new path is taken, with a note
    moved_ck = checkpoint(tmp_path, str(bpe.resolve()), name="moved")
    new = tmp_path / "elsewhere.json"
    bpe.rename(new)
    request = _generate(moved_ck, "--tokenizer", str(new))
    assert request.tokenizer_spec == str(new) and any("no longer exists" in n for n in request.notes)
    assert any("no longer exists" in n for n in _eval(moved_ck, hf_bpe / "text.txt", "--tokenizer", str(new)).notes)
    # ... and without --tokenizer, the error says to pass it (before: "pass data.tokenizer=byte", a train option)
    with pytest.raises(UserError, match="no longer exists; pass --tokenizer PATH/tokenizer.json"):
        _generate(moved_ck)
    with pytest.raises(UserError, match="is not the tokenizer"):  # (moved or not, byte is not a tokenizer.json)
        _generate(moved_ck, "--tokenizer", "byte")


def test_weights_that_name_no_tokenizer_take_the_given_one_with_a_note(tmp_path, hf_bpe):
    old = checkpoint(tmp_path, None)  # a manifest written before longctx recorded the tokenizer
    bare = tmp_path / "bare"
    shutil.copytree(hf_bpe, bare)
    (bare / "tokenizer.json").unlink()
    for ck, said in ((old, "its manifest records no tokenizer"), (f"hf:{bare}", "its directory has no tokenizer.json")):
        for given in ("byte", str(hf_bpe / "tokenizer.json")):
            request = _generate(ck, "--tokenizer", given)
            assert request.tokenizer_spec == given
            assert any(f"--tokenizer {given} is taken unchecked" in n and said in n for n in request.notes), \
                request.notes
            notes = _eval(ck, hf_bpe / "text.txt", "--tokenizer", given).notes
            assert any(f"--tokenizer {given} is taken unchecked" in n for n in notes), notes


def test_a_tokenizer_larger_than_the_embedding_is_refused_even_when_the_prompt_fits(tmp_path, hf_bpe):
    big = str(hf_bpe / "tokenizer.json")
    from longctx.data.tokenizer import load_tokenizer

    vocab = load_tokenizer(big).vocab_size
    assert 290 <= vocab <= 300  # the model below has 290 ids
    ck = checkpoint(tmp_path, None, ["--model.vocab_size=290"])
    assert max(load_tokenizer(big).encode("x")) < 290  # the prompt's ids fit: only the vocabulary tells
    with pytest.raises(UserError, match=f"has {vocab} tokens but the model's vocabulary is 290"):
        _generate(ck, "--tokenizer", big)  # (before: prepared without a word)
    with pytest.raises(UserError, match=f"has {vocab} tokens but the model's vocabulary is 290"):
        _eval(ck, hf_bpe / "text.txt", "--tokenizer", big)  # (eval refused it already)
