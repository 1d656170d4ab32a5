"""`longctx checkpoint export` of a run trained from scratch on a tokenizer.json named by path (export111):

1. With a chat template beside it (ChatML: a turn ends with <|im_end|>), `longctx generate --chat` on the
   checkpoint stops at the end of turn as well as the end of document, but the export wrote config.json's
   eos_token_id (the end of document) alone and no generation_config.json: transformers' generate on the
   export ran past the end of a turn. The export now writes a generation_config.json with the ids generate
   --chat stops at (end of turn first); an hf: source's own generation_config.json is copied unchanged, and
   a tokenizer without a template gets none (as before).
2. A tokenizer file not named tokenizer.json (my_tok.json) was copied under its own name, where
   AutoTokenizer.from_pretrained(export) does not look; it is copied as tokenizer.json now.
"""

import json

import pytest

transformers = pytest.importorskip("transformers")
from test_export_audit import checkpoint  # noqa: E402
from test_generate_chat import IM_END, _chat_tokenizer, _prepare  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.cli import main  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.models.hf import save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402

END_OF_DOCUMENT = 0  # <|endoftext|> of _chat_tokenizer's specials, the token training ended documents with


def _chat_run(tmp_path, name="my_tok.json"):
    """A from-scratch run's checkpoint whose tokenizer is `name` with a ChatML template beside it."""
    tok = tmp_path / "tok"
    tok.mkdir()
    _chat_tokenizer(tok)
    if name != "tokenizer.json":
        (tok / "tokenizer.json").rename(tok / name)
    return checkpoint(tmp_path, str(tok / name)), tok / name


def test_the_export_of_a_chat_run_stops_where_generate_chat_stops(tmp_path):
    step, tok = _chat_run(tmp_path, "tokenizer.json")
    out, _, _, notes = export_hf(step, tmp_path / "out")
    stops = _prepare("--checkpoint", str(step), "--chat", "--prompt", "What is 2 + 2?").eos_ids
    assert sorted(stops) == [END_OF_DOCUMENT, IM_END]
    # transformers' generate reads generation_config.json's eos ids: the end of turn first, then the document's
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [IM_END, END_OF_DOCUMENT]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # (what its generate() reads)
    assert set(model.generation_config.eos_token_id) == set(stops)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == END_OF_DOCUMENT  # (unchanged)
    assert any("generation_config.json" in n and "<|im_end|>" in n for n in notes)


def test_a_source_generation_config_wins_and_no_template_writes_none(tmp_path):
    # an hf: source's own generation_config.json is copied unchanged, even with a chat template beside it
    hf = save_hf(build_model(load_config(overrides=["--model.layers=1"]).model),
                 tmp_path / "source")
    _chat_tokenizer(hf)
    own = json.dumps({"bos_token_id": 1, "eos_token_id": 7})
    (hf / "generation_config.json").write_text(own)
    step = checkpoint(tmp_path, str(hf / "tokenizer.json"), [f"--model.init_from=hf:{hf}"], "from-hf")
    out, _, _, _ = export_hf(step, tmp_path / "out-hf")
    assert (out / "generation_config.json").read_text() == own
    # a tokenizer without a chat template: no generation_config.json (config.json's eos is generate's stop)
    (tmp_path / "plain").mkdir()
    plain = bpe_tokenizer(tmp_path / "plain" / "tokenizer.json")
    out, _, _, _ = export_hf(checkpoint(tmp_path, str(plain), name="plain-run"), tmp_path / "out-plain")
    assert not (out / "generation_config.json").exists()


def test_a_tokenizer_file_of_another_name_is_exported_as_tokenizer_json(tmp_path):
    step, tok = _chat_run(tmp_path, "my_tok.json")
    out, copied, _, _ = export_hf(step, tmp_path / "out")
    assert not (out / "my_tok.json").exists()
    text = "def f(x):\n    return x + 1  # What is 2 + 2?"
    theirs = transformers.AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False)
    assert theirs == Tokenizer.from_file(str(tok)).encode(text, add_special_tokens=False).ids
    assert "tokenizer.json (from my_tok.json)" in copied
    # the generation_config.json of item 1 is found through the renamed file too
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [IM_END, END_OF_DOCUMENT]


def test_the_export_line_says_the_rename(tmp_path, capsys):
    step, _ = _chat_run(tmp_path, "my_tok.json")
    assert main(["checkpoint", "export", str(step), str(tmp_path / "o"), "--to", "hf"]) == 0
    line = capsys.readouterr().out
    assert "tokenizer files: tokenizer.json (from my_tok.json)" in line
    assert "generation_config.json" in line  # (the note: what it holds and why)
