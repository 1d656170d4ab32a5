"""A tokenizer whose end-of-document token is none of the usual strings (DeepSeek's <｜end▁of▁sentence｜>) was
refused ("has none of the end-of-document tokens"), though its tokenizer_config.json names its eos_token. That
one is used now; without it the refusal stands, and says where the token is looked for."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from longctx.data.tokenizer import HFTokenizer
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
