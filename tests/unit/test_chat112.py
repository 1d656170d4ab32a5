"""Chat-template seams of a store's record (data/store_template.py) and of eval's outside-stop message (task chat112).

Failed before:
1. `longctx data merge` recorded the template beside the tokenizer at merge time, not the one that rendered the
   scans (a template edited since: the store claimed the new one); scans rendered by two templates were refused
   as "scanned from other inputs or with other options", naming no template; a merge of scans made before
   templates were recorded claimed the merge-time template for their conversations.
2. `--append --messages-field` to a store built before templates were recorded put its old conversations under
   the current template (train's check vacuous for them), and train said nothing of what it could not check.
3. A chat template file there but unreadable (a link to nothing, not UTF-8) or a malformed tokenizer_config.json
   chat_template was read as "no chat template" (train: "has no chat template"), or passed over for
   tokenizer_config.json's own template (build, generate --chat: rendered with another template, silently).
4. `longctx eval --nproc N` with a rank stopped by a SIGTERM from outside: the launcher's message did not say
   where the finished lengths are kept.
"""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "unit"))
from test_data_build import opts, quiet  # noqa: E402
from test_evalcmd108 import _eval, folder  # noqa: E402, F401 (the module's tiny model, a fixture)
from test_generate_chat import _chat_tokenizer  # noqa: E402
from test_review111 import OTHER_TEMPLATE, _build, _chats  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.data.builder import scan  # noqa: E402
from longctx.data.builder.pipeline import build_store, merge_scans  # noqa: E402
from longctx.data.chat_template import load_chat_template  # noqa: E402
from longctx.data.store import read_manifest, write_manifest  # noqa: E402
from longctx.errors import ConfigError, DataError  # noqa: E402
from longctx.train.setup import build_data, check_store  # noqa: E402


@pytest.fixture()
def tok(tmp_path) -> Path:
    """A chat tokenizer whose template is tokenizer_config.json's chat_template."""
    d = tmp_path / "tok"
    d.mkdir()
    _chat_tokenizer(d)
    return d


def _said(e) -> str:
    return " ".join(str(e).split())


def _edit_template(tok: Path, template: str = OTHER_TEMPLATE) -> None:
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))


def _scan(tok: Path, inputs: list[Path], out: Path, i: int, **kw) -> str:
    build_store(opts(inputs, out, tokenizer=str(tok / "tokenizer.json"), strategy="bfd", dedup="exact",
                     shard=(i, 2), **({"messages_field": "messages"} | kw)), log=quiet)
    return str(out)


def _inputs(tmp_path) -> list[Path]:
    return [_chats(tmp_path / "a.jsonl", 0), _chats(tmp_path / "b.jsonl", 100)]


# ---- 1. data merge


def test_a_merge_records_the_template_that_rendered_its_scans_not_the_one_beside_the_tokenizer_now(tmp_path, tok):
    rendered_by = load_chat_template(str(tok / "tokenizer.json")).digest()
    scans = [_scan(tok, _inputs(tmp_path), tmp_path / f"scan{i}", i) for i in range(2)]
    _edit_template(tok)  # (tokenizer.json as it was: the merge takes it)
    merge_scans(scans, str(tmp_path / "m"), progress=False, log=quiet)
    recorded = read_manifest(tmp_path / "m")["tokenizer"]["chat_template"]
    assert recorded["digest"] == rendered_by and "unrecorded_parts" not in recorded
    # and train, whose tokenizer now has the other template, refuses the store
    with pytest.raises(ConfigError, match="edited since"):
        check_store(load_config(overrides=[f"--data.path={tmp_path / 'm'}", "--train.seq_len=256"]), tmp_path / "m")


def test_scans_rendered_by_two_templates_are_refused_naming_both(tmp_path, tok):
    first = load_chat_template(str(tok / "tokenizer.json")).digest()
    s0 = _scan(tok, _inputs(tmp_path), tmp_path / "scan0", 0)
    _edit_template(tok)
    second = load_chat_template(str(tok / "tokenizer.json")).digest()
    s1 = _scan(tok, _inputs(tmp_path), tmp_path / "scan1", 1)
    with pytest.raises(DataError) as e:
        merge_scans([s0, s1], str(tmp_path / "m"), progress=False, log=quiet)
    said = _said(e.value)
    assert "two chat templates" in said and first[:12] in said and second[:12] in said, said
    assert s0 in said and s1 in said and "--shard i/n" in said, said
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_scans_of_conversations_and_of_plain_text_are_refused_saying_how_to_train_on_both(tmp_path, tok):
    inputs = _inputs(tmp_path)
    s0 = _scan(tok, inputs, tmp_path / "scan0", 0)
    s1 = _scan(tok, inputs, tmp_path / "scan1", 1, messages_field="")
    with pytest.raises(DataError) as e:
        merge_scans([s0, s1], str(tmp_path / "m"), progress=False, log=quiet)
    said = _said(e.value)
    assert "plain text" in said and "conversations" in said and "data.path" in said, said


def test_a_merge_of_scans_made_before_templates_were_recorded_claims_none_and_train_says_so(tmp_path, tok):
    scans = [_scan(tok, _inputs(tmp_path), tmp_path / f"scan{i}", i) for i in range(2)]
    for d in scans:  # (as a scan of a longctx before 2026-12-06 wrote its plan)
        plan = scan.read_plan(Path(d))
        plan.pop("chat_template", None)
        scan.write_plan(Path(d), plan)
    said = []
    merge_scans(scans, str(tmp_path / "m"), progress=False, log=said.append)
    manifest = read_manifest(tmp_path / "m")
    assert "chat_template" not in manifest["tokenizer"], manifest["tokenizer"]
    assert any("before longctx recorded chat templates" in line for line in said), said
    lines = []
    build_data(load_config(overrides=[f"--data.path={tmp_path / 'm'}", "--train.seq_len=256"]), log=lines.append)
    unchecked = [line for line in lines if "could not be checked" in line]
    assert len(unchecked) == 1 and manifest["parts"][0]["dir"] in unchecked[0], lines


# ---- 2. --append to a store built before templates were recorded


def test_an_append_to_a_store_without_a_record_lists_its_old_conversations_as_unrecorded(tmp_path, tok):
    store = _build(tok, _chats(tmp_path / "a.jsonl", 0), tmp_path / "s")
    manifest = read_manifest(store)
    manifest["tokenizer"].pop("chat_template")  # (as a build before 2026-12-06 wrote it)
    write_manifest(store, manifest)
    old_part = manifest["parts"][0]["dir"]
    _build(tok, _chats(tmp_path / "b.jsonl", 100), store, append=True)
    after = read_manifest(store)
    recorded = after["tokenizer"]["chat_template"]
    assert recorded["digest"] == load_chat_template(str(tok / "tokenizer.json")).digest()  # (the new part's)
    assert recorded.get("unrecorded_parts") == [old_part], recorded
    lines = []
    build_data(load_config(overrides=[f"--data.path={store}", "--train.seq_len=256"]), log=lines.append)
    unchecked = [line for line in lines if "could not be checked" in line]
    assert len(unchecked) == 1 and old_part in unchecked[0] and after["parts"][1]["dir"] not in unchecked[0], lines
    # a later append keeps the list
    _build(tok, _chats(tmp_path / "c.jsonl", 200), store, append=True)
    assert read_manifest(store)["tokenizer"]["chat_template"]["unrecorded_parts"] == [old_part]


def test_conversations_appended_to_a_store_of_plain_text_are_all_recorded(tmp_path, tok):
    """(A guard: plain text was rendered by no template, so nothing is unknown.)"""
    text = tmp_path / "text"
    text.mkdir()
    (text / "doc.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    store = tmp_path / "s"
    build_store(opts([text], store, tokenizer=str(tok / "tokenizer.json"), strategy="bfd", dedup="exact"), log=quiet)
    assert "chat_template" not in read_manifest(store)["tokenizer"]
    _build(tok, _chats(tmp_path / "a.jsonl", 0), store, append=True)
    assert "unrecorded_parts" not in read_manifest(store)["tokenizer"]["chat_template"]


# ---- 3. a template file there but unreadable


def _broken_link(tok: Path) -> Path:
    jinja = tok / "chat_template.jinja"
    os.symlink(tok / "gone" / "chat_template.jinja", jinja)
    return jinja


def test_a_build_refuses_a_template_file_it_cannot_read_rather_than_use_another(tmp_path, tok):
    jinja = _broken_link(tok)  # (tokenizer_config.json still holds a template: HEAD rendered with that one)
    with pytest.raises((ConfigError, DataError)) as e:
        _build(tok, _chats(tmp_path / "a.jsonl", 0), tmp_path / "s")
    assert str(jinja) in _said(e.value) and "link to a missing file" in _said(e.value), _said(e.value)
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_train_names_the_unreadable_template_file_not_a_missing_template(tmp_path, tok):
    store = _build(tok, _chats(tmp_path / "a.jsonl", 0), tmp_path / "s")
    jinja = tok / "chat_template.jinja"
    jinja.write_bytes(b"\xff\xfe{{ messages }}")  # (not UTF-8)
    with pytest.raises(ConfigError) as e:
        check_store(load_config(overrides=[f"--data.path={store}", "--train.seq_len=256"]), store)
    said = _said(e.value)
    assert str(jinja) in said and "UTF-8" in said and "no chat template" not in said, said


@pytest.mark.parametrize("malformed", [[{"name": "default", "template": None}], [{"name": "default", "template": 7}]])
def test_generate_chat_refuses_a_malformed_named_template(tmp_path, tok, malformed):
    from longctx.generate.prompts import apply_chat

    _edit_template(tok, malformed)
    with pytest.raises(ConfigError) as e:
        apply_chat([{"text": "What is 2 + 2?"}], str(tok / "tokenizer.json"))
    said = _said(e.value)
    assert str(tok / "tokenizer_config.json") in said and '"default"' in said and "no chat template" not in said


def test_generate_chat_refuses_a_template_file_it_cannot_read_rather_than_use_another(tmp_path, tok):
    from longctx.generate.prompts import apply_chat

    jinja = _broken_link(tok)
    with pytest.raises(ConfigError) as e:
        apply_chat([{"text": "What is 2 + 2?"}], str(tok / "tokenizer.json"))
    assert str(jinja) in _said(e.value)


def test_a_tokenizer_without_a_template_is_still_just_that(tmp_path, tok):
    """(A guard: none there is not an error of its own; train says the store's template is missing.)"""
    store = _build(tok, _chats(tmp_path / "a.jsonl", 0), tmp_path / "s")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(tok / "tokenizer.json", bare / "tokenizer.json")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    cfg = load_config(overrides=[f"--data.path={store}", f"--data.tokenizer={bare / 'tokenizer.json'}",
                                 "--train.seq_len=256"])
    with pytest.raises(ConfigError, match="no chat template"):
        check_store(cfg, store)


# ---- 4. eval stopped from outside under --nproc


def test_evals_launcher_names_where_the_finished_lengths_are_kept_when_a_rank_was_stopped_from_outside(
        folder, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Rank 1 SIGTERMed by a `kill` of it alone, rank 0 losing it mid-collective (its lost peer noted): the
    launcher's message named rank 1 and its signal, not out.incomplete.json, where rank 0 kept the lengths done."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from longctx.job import relaunch

    def failure(rank, code):
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file=str(tmp_path / "none"))
        f.timestamp = 100
        return f

    def run(_args):
        folder = Path(os.environ[relaunch.ERROR_DIR_ENV])
        (folder / "lostpeer0.json").write_text(json.dumps({"time": 5.0, "error": "RuntimeError: Connection reset"}))
        raise ChildFailedError("longctx", {0: failure(0, 1), 1: failure(1, 128 + int(signal.SIGTERM))})

    monkeypatch.setattr(relaunch, "run", run)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out.json"
    assert _eval(folder, "ppl", "--output", str(out), "--nproc", "2") == 128 + int(signal.SIGTERM)
    said = _said(capsys.readouterr().err)
    assert "rank 1 of 2 was stopped by SIGTERM" in said, said
    assert str(tmp_path / "out.incomplete.json") in said, said


def test_an_export_does_not_read_an_unreadable_template_as_none(tmp_path, tok):
    """An export's generation stops (checkpoint/export.py _chat_stops) came from the template: one that cannot be
    read was taken for a base tokenizer's none, and the export wrote no end-of-turn stop without a word. (The
    template is read once, by _read_template, which _chat_stops takes it from.)"""
    from longctx.checkpoint.export import _read_template

    work = tmp_path / "export"
    shutil.copytree(tok, work)
    (work / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")  # (not UTF-8)
    with pytest.raises(ConfigError) as e:
        _read_template(work)
    assert str(work / "chat_template.jinja") in _said(e.value), _said(e.value)
    assert not (work / "generation_config.json").exists()


def test_evals_launcher_names_the_kept_file_when_its_own_signal_stopped_the_job():
    """The launcher's own SIGTERM (a scheduler's, to `longctx eval --nproc N`): the message said "--output's
    .incomplete file" without naming it, though eval had named it (`kept`)."""
    from longctx.eval.stopped import kept_where
    from longctx.job.relaunch import _stopped_by

    said = _said(_stopped_by("SIGTERM", "eval", kept_where("/runs/out.json")))
    assert "/runs/out.incomplete.json" in said and said.startswith("stopped by SIGTERM before `longctx eval`"), said
    assert "lines it finished" in _stopped_by("SIGTERM", "generate")  # (generate names no file: its fallback)


def test_generates_outside_stop_says_what_it_keeps_as_the_launchers_own_stop_does():
    """A generate rank stopped by a signal sent to it alone: the launcher's message said nothing of the lines kept
    in FILE.partial, which its message for its own signal says (one rule for both now)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from longctx.job.relaunch import _first_failure, _stopped_by

    def failure(rank, code):
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
        f.timestamp = 100
        return f

    error = _first_failure({0: failure(0, 1), 1: failure(1, 128 + int(signal.SIGTERM))}, 2, command="generate",
                           lost={0: 5.0})
    said = _said(error)
    assert said.startswith("rank 1 of 2 was stopped by SIGTERM"), said
    kept = _said(_stopped_by("SIGTERM", "generate")).split("(it saves no checkpoint): ")[1].rstrip(".")
    assert kept in said and "FILE.partial" in said, said
