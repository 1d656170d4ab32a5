"""`--stop "<|im_end|>"`: a stop string that is a special token's text (the usual cure for a chat model whose EOS
leaves out its end of turn). Decode leaves special tokens out of the text, so matched on the text it never
matched and the row ran on into another turn (an audit's finding); it now ends the row when that token is
generated, as transformers' stop strings do, with the text stops working beside it. A stop string holding a
special token's text among other text could never match and is refused."""

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from longctx.config import load_config
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import ConfigError
from longctx.generate.engine import generate
from longctx.generate.output import StopStrings
from longctx.models.llama import build_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("special_stop")
    t = Tokenizer(models.BPE(vocab={chr(97 + i): i for i in range(26)} | {"<unk>": 26}, merges=[], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.decoder = decoders.Fuse()
    t.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    t.save(str(d / "tokenizer.json"))
    return load_tokenizer(str(d / "tokenizer.json"))


def test_a_special_tokens_text_ends_the_row_when_it_is_generated(tok):
    end = tok.special_tokens()["<|im_end|>"]
    stops = StopStrings(tok, ["<|im_end|>", "xy"])
    assert stops.stop_ids == {end} and stops.stops == ["xy"]
    assert stops(0, [0, 1, end]) and not stops(0, [0, 1, 2]) and stops(0, [0, 23, 24])  # ("xy": a, b, x, y)
    model = build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=29"]).model, seed=3)
    free = generate(model, [[0, 1, 2]], max_new_tokens=12)[0].tokens
    special = StopStrings(tok, ["<|im_end|>"])
    special.stop_ids = {free[4]}  # (the fifth new token taken as the special one: the path a row ends by)
    out = generate(model, [[0, 1, 2]], max_new_tokens=12, stop=special)[0]
    assert out.finish_reason == "stop" and out.tokens == free[:5]


def test_a_stop_holding_a_special_token_among_other_text_is_refused(tok):
    with pytest.raises(ConfigError, match="holds the special token '<\\|im_end\\|>', which the generated text never "
                                          "shows.*give --stop '<\\|im_end\\|>' on its own"):
        StopStrings(tok, ["<|im_end|>\n"])
