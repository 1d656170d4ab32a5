"""A tokenizer whose end-of-document token is none of the usual strings (DeepSeek's <｜end▁of▁sentence｜>) was
refused ("has none of the end-of-document tokens"), though its tokenizer_config.json names its eos_token. That
one is used now; without it the refusal stands, and says where the token is looked for."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from longctx.data.tokenizer import HFTokenizer, tokenizer_digest
from longctx.errors import DataError

EOS = "<｜end▁of▁sentence｜>"


def _tokenizer(folder, config):
    vocab = {"[UNK]": 0, "a": 1, "b": 2, EOS: 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


@pytest.mark.parametrize("config", [{"eos_token": EOS}, {"eos_token": {"content": EOS, "special": True}}])
def test_the_configs_eos_token_separates_documents(tmp_path, config):
    assert HFTokenizer(_tokenizer(tmp_path / "t", config)).eos_id == 3


@pytest.mark.parametrize("config", [None, {"eos_token": "<not in the vocabulary>"}, {"bos_token": EOS}])
def test_without_it_the_tokenizer_is_refused(tmp_path, config):
    with pytest.raises(DataError, match="tokenizer_config.json beside it"):
        HFTokenizer(_tokenizer(tmp_path / "t", config))


def test_the_configs_eos_token_is_part_of_the_tokenizers_identity(tmp_path):
    """A store cached or half-built with one eos_token must not be taken for one built with another: the digest
    (what stores and builds check their tokenizer against) changes with the config's eos_token where that is the
    one used, and only there (a tokenizer with a usual end token keeps its digest whatever the config says)."""
    first = _tokenizer(tmp_path / "one", {"eos_token": EOS})
    other = _tokenizer(tmp_path / "two", {"eos_token": "a"})
    assert tokenizer_digest(str(first)) != tokenizer_digest(str(other))
    assert tokenizer_digest(str(first.parent)) == tokenizer_digest(str(first))

    usual = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "</s>": 2}, unk_token="[UNK]"))
    digests = set()
    for name, config in (("u1", {"eos_token": "a"}), ("u2", {"eos_token": "</s>"}), ("u3", None)):
        (tmp_path / name).mkdir()
        usual.save(str(tmp_path / name / "tokenizer.json"))
        if config:
            (tmp_path / name / "tokenizer_config.json").write_text(json.dumps(config))
        digests.add(tokenizer_digest(str(tmp_path / name)))
    assert len(digests) == 1
