"""Review of session 111's chat-template check (data/store_template.py): the cases it missed.

- (a guard, passing before too) a mix of stores rendered by two templates beside one tokenizer.json, data.tokenizer
  left auto: the config resolves it to the first store's tokenizer, against which every store is checked;
- `longctx data build --append --messages-field` after the template was edited: the manifest recorded the
  new template over the old one, though the store's earlier conversations hold the old format;
- a run whose tokenizer is another tokenizer altogether was told of chat templates, not of the tokenizer.
- a template file edited since the build was named as both templates ("rendered by X, but ... has X").
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "unit"))
from test_data_build import opts, quiet  # noqa: E402
from test_generate_chat import _chat_tokenizer  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.data.store import read_manifest  # noqa: E402
from longctx.errors import ConfigError, DataError  # noqa: E402
from longctx.train.setup import check_mix, check_store  # noqa: E402

OTHER_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}### assistant: {% endif %}")


def _chats(path: Path, first: int, n: int = 12) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"{2 * i}."}]}) + "\n"
                            for i in range(first, first + n)))
    return path


def _build(tokenizer_dir: Path, chats: Path, out: Path, **kw) -> Path:
    build_store(opts([chats], out, tokenizer=str(tokenizer_dir / "tokenizer.json"), messages_field="messages",
                     strategy="bfd", dedup="exact", **kw), log=quiet)
    return out


@pytest.fixture()
def two_templates(tmp_path):
    """Two folders holding the same tokenizer.json: `base` with its template, `instruct` with another."""
    base = tmp_path / "base"
    base.mkdir()
    _chat_tokenizer(base)
    instruct = tmp_path / "instruct"
    instruct.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(base / name, instruct / name)
    (instruct / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    return base, instruct


def test_a_mix_of_stores_rendered_by_two_templates_is_refused_under_auto(tmp_path, two_templates):
    base, instruct = two_templates
    a = _build(base, _chats(tmp_path / "a.jsonl", 0), tmp_path / "a")
    b = _build(instruct, _chats(tmp_path / "b.jsonl", 100), tmp_path / "b")
    cfg = load_config(overrides=[f"--data.path={a},{b}", "--train.seq_len=256"])  # (data.tokenizer left auto)
    with pytest.raises(ConfigError) as e:  # the run's tokenizer is a's (the first store's): b's format is not its
        check_mix(cfg)
    msg = " ".join(str(e.value).split())
    assert str(b) in msg and str(instruct / "chat_template.jinja") in msg
    # two stores of one template mix
    a2 = _build(base, _chats(tmp_path / "a2.jsonl", 200), tmp_path / "a2")
    check_mix(load_config(overrides=[f"--data.path={a},{a2}", "--train.seq_len=256"]))


def test_an_append_under_another_template_is_refused(tmp_path, two_templates):
    base, _ = two_templates
    store = _build(base, _chats(tmp_path / "a.jsonl", 0), tmp_path / "a")
    before = read_manifest(store)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER_TEMPLATE}))
    with pytest.raises((ConfigError, DataError)) as e:
        _build(base, _chats(tmp_path / "b.jsonl", 100), store, append=True)
    assert "chat template" in str(e.value) and "--append" in " ".join(str(e.value).split())
    assert read_manifest(store) == before  # (refused before any work: the store is as it was)
    # the template put back: the append goes on
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    _build(base, _chats(tmp_path / "b.jsonl", 100), store, append=True)
    assert read_manifest(store)["tokenizer"]["chat_template"] == before["tokenizer"]["chat_template"]


def test_another_tokenizer_is_named_as_such_not_as_a_template(tmp_path, two_templates):
    base, _ = two_templates
    store = _build(base, _chats(tmp_path / "a.jsonl", 0), tmp_path / "a")
    other = tmp_path / "other"
    other.mkdir()
    tok = json.loads((base / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {k: v for k, v in tok["model"]["vocab"].items() if v < 280}  # another vocabulary
    tok["model"]["merges"] = []
    (other / "tokenizer.json").write_text(json.dumps(tok))  # (no template beside it)
    cfg = load_config(overrides=[f"--data.path={store}", f"--data.tokenizer={other / 'tokenizer.json'}",
                                 "--train.seq_len=256"])
    with pytest.raises(ConfigError, match="was tokenized with"):
        check_store(cfg, store)


def test_a_template_edited_since_the_build_is_said_so(tmp_path, two_templates):
    """The store's template file, edited since (here a special token it reads): the refusal named one file as
    both templates ("rendered by the chat template X, but the run's tokenizer has the chat template X")."""
    base, _ = two_templates
    store = _build(base, _chats(tmp_path / "a.jsonl", 0), tmp_path / "a")
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    with pytest.raises(ConfigError) as e:
        check_store(load_config(overrides=[f"--data.path={store}", "--train.seq_len=256"]), store)
    assert "edited since the store was built" in " ".join(str(e.value).split())


def test_a_first_failure_that_only_lost_a_peer_is_not_sent_back_to_its_output():
    """Rank 1 left a 2-rank job early without an error (exit 0: not a failure to torchrun) while rank 0 was in a
    collective: rank 0 notes the lost peer and prints one line, "the launcher says which rank ended first, and
    how", and the launcher said "rank 0 of 2 failed first (exit code 1) ... See that rank's output above for its
    error": each pointing at the other, the traceback gone."""
    from types import SimpleNamespace

    from longctx.job import relaunch

    failures = {0: SimpleNamespace(exitcode=1, timestamp=100, pid=1000)}
    said = " ".join(str(relaunch._first_failure(failures, 2, [], {}, "train", lost={0: 5.0},
                                                torchrun_stopped=set())).split())
    assert said.startswith("rank 0 of 2 failed first"), said
    assert "See that rank's output" not in said and "lost a peer" in said, said
