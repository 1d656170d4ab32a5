"""Review of the 2026-12-06 changes (review112).

`checkpoint export` read the chat template (for generation_config.json's end-of-turn stop) in its own scratch copy
of the tokenizer files: a template file that cannot be read was an error naming `--chat`, a flag the export has
none of, and a file in the hidden scratch directory the failed export then removed, said after the whole model was
read; and a chat_template.jinja that is a link to nothing was not copied at all, so the stops came from
tokenizer_config.json's template without a word. The export now reads the template where it copies from, before
the weights.
"""

import pytest

pytest.importorskip("transformers")
from test_export_audit import checkpoint  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402

from longctx.checkpoint import export as export_module  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


def _chat_run(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    _chat_tokenizer(tok)  # (its template in tokenizer_config.json)
    return checkpoint(tmp_path, str(tok / "tokenizer.json")), tok


def _said(error) -> str:
    return " ".join(str(error).split())


def test_an_unreadable_template_is_named_where_the_export_reads_it_before_the_weights(tmp_path, monkeypatch):
    step, tok = _chat_run(tmp_path)
    (tok / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")  # (not UTF-8)
    read = []
    real = export_module.load_model_weights
    monkeypatch.setattr(export_module, "load_model_weights", lambda *a, **k: (read.append(a), real(*a, **k))[1])
    with pytest.raises(ConfigError) as e:
        export_module.export_hf(step, tmp_path / "out")
    said = _said(e.value)
    assert str(tok / "chat_template.jinja") in said, said  # (the file to restore, not its scratch copy)
    assert "--chat" not in said and ".exporting" not in said and "checkpoint export" in said, said
    assert read == []  # (said before the weights were read)
    assert not (tmp_path / "out").exists()


def test_a_template_link_to_nothing_is_not_passed_over_for_tokenizer_configs(tmp_path):
    step, tok = _chat_run(tmp_path)
    (tok / "chat_template.jinja").symlink_to(tmp_path / "gone.jinja")
    with pytest.raises(ConfigError) as e:
        export_module.export_hf(step, tmp_path / "out")
    said = _said(e.value)
    assert str(tok / "chat_template.jinja") in said and "a link to a missing file" in said, said
    assert not (tmp_path / "out").exists()
