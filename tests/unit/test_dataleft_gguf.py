"""Leftovers of the GGUF import (helper dataleft): an architecture longctx does not import (qwen35, qwen35moe: the
gguf package names them, transformers' reader does not read them) failed in read_config with a bare KeyError,
"transformers cannot read odd.gguf: 'qwen35.attention.key_length'"; it is refused by name before transformers reads
the file, listing the ones imported. The tokenizer.json the import writes was indented (the tokenizers library's
pretty form, and indent=2 where invented tokens were dropped): it is written compact, the same JSON value."""

import json

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from tokenizers import Tokenizer, models  # noqa: E402

import gguf_fuzz119_reference as R  # noqa: E402
from longctx.checkpoint import gguf_checks, gguf_import  # noqa: E402
from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf  # noqa: E402


def _nothing_read(monkeypatch):
    """Fail the test where the import reaches transformers' config or model reading."""
    def reached(*args, **kwargs):
        raise AssertionError("transformers read the file before the refusal")

    monkeypatch.setattr(gguf_import, "read_config", reached)
    monkeypatch.setattr(gguf_import, "load_model", reached)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe", "qwen3next", "gemma3", "mistral3"])
def test_an_architecture_longctx_does_not_import_is_refused_by_name_first(tmp_path, monkeypatch, arch):
    assert arch in gguf.MODEL_ARCH_NAMES.values()  # (named by the gguf package: past check_architecture's first test)
    source = tmp_path / "odd.gguf"
    R.write(R.draw(0), source, arch=arch)
    _nothing_read(monkeypatch)
    with pytest.raises(GGUFImportError) as caught:
        import_gguf(source, tmp_path / "out")
    message = str(caught.value)
    assert f"general.architecture = '{arch}'" in message and "does not import" in message, message
    assert all(name in message for name in gguf_checks.IMPORTED_ARCHITECTURES), message
    assert not (tmp_path / "out").exists()


def test_the_imported_architectures_are_ones_transformers_reads():
    """The list does not refuse a file that imports: each name is one transformers' GGUF reader takes (its own
    spelling for the MoE ones), and the fuzz / MoE / families tests import llama, qwen2, qwen3, qwen2moe, qwen3moe."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    spelled = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
    assert all(spelled.get(a, a) in GGUF_SUPPORTED_ARCHITECTURES for a in gguf_checks.IMPORTED_ARCHITECTURES)


def test_a_key_missing_from_the_metadata_is_named_with_the_way_out(tmp_path, monkeypatch):
    def missing(*args, **kwargs):
        raise KeyError("llama.attention.head_count")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", missing)
    with pytest.raises(GGUFImportError, match=r"lacks the key 'llama.attention.head_count'.*convert_hf_to_gguf"):
        gguf_import.read_config(tmp_path / "x.gguf")


def _pretty_tokenizer(directory, added):
    vocab = {c: i for i, c in enumerate("abcdefgh")}
    vocab["ab"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.add_special_tokens(added)
    tok.save(str(directory / "tokenizer.json"))  # (pretty, as transformers' save_pretrained writes it)
    return json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("file_tokens", [None, 9, 10])
def test_the_tokenizer_json_is_written_compact_with_the_same_value(tmp_path, file_tokens):
    """file_tokens None or 10: nothing invented, the file was left indented (the tokenizers library's form); 9: the
    token past the file's vocabulary is dropped, and the file was rewritten with indent=2."""
    before = _pretty_tokenizer(tmp_path, ["<|endoftext|>"])
    assert "\n" in (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
    gguf_import.drop_invented_tokens(tmp_path, file_tokens)
    text = (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
    assert "\n" not in text and ": " not in text and ", " not in text, text[:200]
    if file_tokens == 9:
        before["added_tokens"] = []
    assert json.loads(text) == before
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size() == 9 + (file_tokens != 9)


def test_an_import_writes_its_tokenizer_json_compact(tmp_path):
    d = R.draw(1)
    source = tmp_path / "f.gguf"
    R.write(d, source)
    if d.rope_scaling.get("rope.scaling.type", "none") != "none":
        pytest.skip("draw 1 has RoPE scaling (refused)")
    import_gguf(source, tmp_path / "out", dtype="fp32")
    text = (tmp_path / "out" / "tokenizer.json").read_text(encoding="utf-8")
    assert "\n" not in text and text.startswith('{"version":'), text[:80]
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in d.tokens] == list(range(len(d.tokens)))
