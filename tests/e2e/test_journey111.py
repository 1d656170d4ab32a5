"""A user's fine-tuning journey across the seams between commands (journey111): `longctx data build
--messages-field` renders conversations with the chat template beside `--tokenizer`; `longctx train` from
`hf:DIR` checks only that the store's tokenizer.json is DIR's, and `longctx generate --chat` and
`checkpoint export` then use the template beside the run's tokenizer. A base model and its instruct release
(or a template edited since the build) hold the same tokenizer.json with different templates: the model was
trained on one chat format and prompted in another, without a word. Such a run is refused before any work
now (data/store_template.py)."""

import json
import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "unit"))
from test_data_build import opts, quiet  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402
from test_tokenizer_follows_model import hf_model_dir  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.train.setup import check_store  # noqa: E402

OTHER_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}### assistant: {% endif %}")
RECORDS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                         {"role": "assistant", "content": f"{2 * i}, since {i} + {i} = {2 * i}."}]} for i in range(12)]


def _store(tokenizer_dir: Path, chats: Path, out: Path) -> Path:
    build_store(opts([chats], out, tokenizer=str(tokenizer_dir / "tokenizer.json"), messages_field="messages",
                     strategy="bfd", dedup="exact"), log=quiet)
    return out


def _check(model_dir: Path, store: Path) -> None:
    cfg = load_config(overrides=[f"--model.init_from=hf:{model_dir}", f"--data.path={store}",
                                 "--train.seq_len=256"])
    check_store(cfg, store)


def test_a_store_of_conversations_rendered_by_another_template_is_refused(tmp_path):
    model = hf_model_dir(tmp_path / "base", tokenizer=False)
    _chat_tokenizer(model)  # (the model's own template: tokenizer_config.json's chat_template)
    instruct = tmp_path / "instruct"  # the same tokenizer.json, another template
    instruct.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model / name, instruct / name)
    (instruct / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))

    own = _store(model, chats, tmp_path / "own")
    _check(model, own)  # the model's own template: trains
    other = _store(instruct, chats, tmp_path / "other")
    with pytest.raises(ConfigError) as e:
        _check(model, other)
    msg = " ".join(str(e.value).split())
    assert str(instruct / "chat_template.jinja") in msg and str(model / "tokenizer_config.json") in msg
    assert "generate --chat" in msg and "--tokenizer" in msg

    # the model's template edited since its store was built: the store holds the old format
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER_TEMPLATE}))
    with pytest.raises(ConfigError, match="another"):
        _check(model, own)
    # a model without a template (a base model) trained on conversations: its export has none to prompt with
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no chat template"):
        _check(model, own)


def test_the_export_carries_the_chat_template_generate_renders_with(tmp_path):
    """A run whose tokenizer is a tokenizer.json named by path (data.tokenizer, a from-scratch or SFT run on a
    borrowed tokenizer): `longctx generate --chat` on its checkpoint renders chat_template.jinja beside it, but
    the export copied tokenizer.json and tokenizer_config.json alone, so the export had no template
    (AutoTokenizer's apply_chat_template raised; `generate --chat` on the export was refused)."""
    transformers = pytest.importorskip("transformers")
    from test_export_audit import checkpoint

    from longctx.checkpoint.export import export_hf
    from longctx.data.chat_template import load_chat_template

    tok = tmp_path / "tok"
    tok.mkdir()
    _chat_tokenizer(tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    (tok / "chat_template.jinja").write_text(OTHER_TEMPLATE)  # (where transformers' save_pretrained writes it)
    out, copied, _, _ = export_hf(checkpoint(tmp_path, str(tok / "tokenizer.json")), tmp_path / "out")
    assert "chat_template.jinja" in copied
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ours = load_chat_template(str(tok / "tokenizer.json")).render(messages)  # what generate --chat renders
    theirs = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(messages, tokenize=False,
                                                                                 add_generation_prompt=True)
    assert theirs == ours == "### user: What is 2 + 2?<|im_end|>\n### assistant: "
    assert load_chat_template(str(out / "tokenizer.json")).render(messages) == ours  # generate --chat on the export
