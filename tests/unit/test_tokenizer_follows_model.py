"""The tokenizer follows the model: `data.tokenizer = auto` resolves to the weights' own tokenizer,
and a tokenizer or store that is not the model's is refused before any work (never byte ids fed to
a model that means another tokenizer's ids)."""

import json

import pytest

from longctx.config import load_config
from longctx.config.tokenizer import same_tokenizer, tokenizer_identity
from longctx.errors import UserError
from longctx.models.hf import save_hf
from longctx.models.llama import build_model


def bpe_tokenizer(path, vocab_size=300):
    """A small byte-level BPE tokenizer.json trained on a few lines of Python-like text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.getcwd())\n"] * 50
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.save(str(path))
    return path


def hf_model_dir(tmp, tokenizer=True):
    """A random debug-shaped Llama in Hugging Face format, with its own tokenizer.json."""
    cfg = load_config(overrides=["--model.layers=1"]).model
    out = save_hf(build_model(cfg), tmp)
    if tokenizer:
        bpe_tokenizer(out / "tokenizer.json")
    return out


def test_auto_is_the_hf_models_own_tokenizer(tmp_path):
    d = hf_model_dir(tmp_path / "hf")
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}"])
    assert cfg.data.tokenizer == str((d / "tokenizer.json").resolve())
    # the same file named another way, or a copy of it, is the same tokenizer
    copy = tmp_path / "copy.json"
    copy.write_bytes((d / "tokenizer.json").read_bytes())
    assert load_config(overrides=[f"--model.init_from=hf:{d}", f"--data.tokenizer={d}"]).data.tokenizer
    assert load_config(overrides=[f"--model.init_from=hf:{d}", f"--data.tokenizer={copy}"]).data.tokenizer
    assert same_tokenizer(str(copy), str(d)) and tokenizer_identity(str(copy)).startswith("sha256:")


def test_a_tokenizer_that_is_not_the_models_is_refused_naming_both(tmp_path):
    d = hf_model_dir(tmp_path / "hf")
    other = bpe_tokenizer(tmp_path / "other.json", vocab_size=280)
    for given in ("byte", str(other)):
        with pytest.raises(UserError) as e:
            load_config(overrides=[f"--model.init_from=hf:{d}", f"--data.tokenizer={given}"])
        msg = " ".join(str(e.value).split())
        assert repr(given) in msg and str((d / "tokenizer.json").resolve()) in msg and "Drop data.tokenizer" in msg


def test_an_hf_model_without_a_tokenizer_needs_one_named_before_data_is_built(tmp_path):
    from longctx.train.preflight import preflight

    d = hf_model_dir(tmp_path / "hf", tokenizer=False)
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}"])
    assert cfg.data.tokenizer == "auto"  # unknown: never silently byte
    with pytest.raises(UserError, match="has no tokenizer.json"):
        preflight(cfg, 1, log=lambda *a: None)
    # said explicitly, byte is taken (a random model trained on bytes)
    assert load_config(overrides=[f"--model.init_from=hf:{d}", "--data.tokenizer=byte"]).data.tokenizer == "byte"


def test_a_store_of_another_tokenizer_is_refused(tmp_path):
    """A store built with bytes, given to a model with its own BPE tokenizer: refused, naming both."""
    from longctx.train.setup import _check_store

    d = hf_model_dir(tmp_path / "hf")
    manifest = {"seq_len": 128, "tokenizer": {"spec": "byte", "name": "byte", "identity": "byte", "vocab_size": 258}}
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", "--data.path=store", "--train.seq_len=128"])
    with pytest.raises(UserError) as e:
        _check_store(cfg, "store", manifest)
    msg = " ".join(str(e.value).split())
    assert "tokenized with byte" in msg and str((d / "tokenizer.json").resolve()) in msg


def test_a_model_trained_from_scratch_takes_the_stores_tokenizer_or_bytes(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    tok = bpe_tokenizer(tmp_path / "tok.json")
    (store / "manifest.json").write_text(json.dumps({"tokenizer": {"spec": str(tok)}}))
    assert load_config(overrides=[f"--data.path={store}"]).data.tokenizer == str(tok)
    assert load_config().data.tokenizer == "byte"
