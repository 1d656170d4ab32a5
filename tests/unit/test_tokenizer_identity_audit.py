"""A checkpoint names its run's tokenizer by content as well as by path (audit 'tokid'), and two holes
in `longctx data build`'s input checks.

- The manifest records `tokenizer_identity`, the sha256 of the run's tokenizer.json as data stores record
  it. Before, it held only the path: once that file had moved, `longctx generate`/`eval` took any
  --tokenizer "unchecked" (a wrong one fed the model ids that mean other text), and a file edited at
  the recorded path was taken as the weights' own without a word (generate, eval, export's copy).
  Now a moved file is recognised by content, a different one is refused, and an edited one is said.
- A `latest` holding bytes that are no UTF-8 raised a raw UnicodeDecodeError (verify, resume auto);
  now it is treated as the garbled `latest` it is: the newest complete checkpoint, as for other garbage.
- `data build --input docs docs` (or docs docs/sub) read every file once per input: with --dedup none
  each document went into the store twice. `--text-field ''` read no .jsonl record's text (each skipped
  as having none) while the text files beside it built a store without a word.
"""

import hashlib
import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")
from test_data_build import opts, quiet  # noqa: E402
from test_export_audit import checkpoint  # noqa: E402  (a 1-step, 1-layer longctx checkpoint, vocab 320)
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.checkpoint.manifest import read_manifest, write_manifest  # noqa: E402
from longctx.checkpoint.verify_command import verify_lines  # noqa: E402
from longctx.cli import build_parser  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.checkpoint_paths import resolve_checkpoint  # noqa: E402
from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.errors import DataError, UserError  # noqa: E402
from longctx.train.trainer import Trainer  # noqa: E402

TEXTS = ["def f(x):\n    return x + 1\n" * (3 + i) + "class A:\n    pass\n" * (i % 4) + "import os\n" * 2
         for i in range(12)]


def sha(path):
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _generate(ck, *argv):
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", str(ck), "--prompt", "x",
                                                            "--max-new-tokens", "2", *argv])
    return prepare(args, rest)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(a checkpoint a 1-step run wrote, trained on a store built with the BPE tokenizer `tok`, its bytes)."""
    tmp = tmp_path_factory.mktemp("tokid")
    (tmp / "tok").mkdir()
    tok = bpe_tokenizer(tmp / "tok" / "tokenizer.json")
    docs = tmp / "docs"
    docs.mkdir()
    for i, t in enumerate(TEXTS):
        (docs / f"d{i:02d}.py").write_text(t)
    build_store(opts([docs], tmp / "store", 64, tokenizer=str(tok), strategy="bfd", dedup="none"), log=quiet)
    cfg = load_config(None, ["--model.layers=1", "--model.vocab_size=320", f"--data.path={tmp / 'store'}",
                             "--train.seq_len=64", "--train.steps=1", "--train.global_batch=2",
                             "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                             "--train.device=cpu", "--checkpoint.final=true", f"--train.run_dir={tmp / 'run'}"])
    Trainer(cfg, log=quiet).run()
    return tmp / "run" / "checkpoints" / "step-00000001", tok, tok.read_bytes()


def test_a_run_records_its_tokenizers_content_beside_its_path(trained):
    step, tok, content = trained
    manifest = read_manifest(step)
    assert manifest["tokenizer"] == str(tok.resolve())
    # the store's identity (data/builder/manifest.py), computed here from the bytes: before, absent
    assert manifest.get("tokenizer_identity") == "sha256:" + hashlib.sha256(content).hexdigest()


def test_a_moved_tokenizer_is_recognised_by_content_and_another_is_refused(trained, tmp_path):
    step, tok, content = trained
    other = bpe_tokenizer(tmp_path / "other.json", vocab_size=280)
    moved = tmp_path / "moved" / "tokenizer.json"
    moved.parent.mkdir()
    tok.rename(moved)
    try:
        request = _generate(step, "--tokenizer", str(moved))  # before: taken, with an "unchecked" note
        assert request.tokenizer_spec == str(moved) and not any("--tokenizer" in n for n in request.notes), \
            request.notes
        with pytest.raises(UserError) as e:  # before: taken unchecked (the model read other text's ids)
            _generate(step, "--tokenizer", str(other))
        msg = " ".join(str(e.value).split())
        assert f"--tokenizer {other} is not the tokenizer" in msg and sha(moved) in msg and sha(other) in msg, msg
        lines, problems = verify_lines(step)
        assert not problems and "no longer there" in lines[2] and sha(moved) in lines[2], lines[2]
        # training on from the checkpoint takes the moved file too (before: "does not exist", whatever was given)
        on = load_config(overrides=[f"--model.init_from={step}", f"--data.tokenizer={moved}"])
        assert on.data.tokenizer == str(moved.resolve())
        with pytest.raises(UserError, match="is not the tokenizer of model.init_from"):
            load_config(overrides=[f"--model.init_from={step}", f"--data.tokenizer={other}"])
    finally:
        moved.rename(tok)


def test_a_tokenizer_edited_at_its_recorded_path_is_not_taken_as_the_weights_own(trained, tmp_path):
    step, tok, content = trained
    bpe_tokenizer(tok, vocab_size=280)  # another tokenizer written over the recorded file
    assert tok.read_bytes() != content
    try:
        with pytest.raises(UserError, match="has changed since"):  # before: used without a word
            _generate(step)
        with pytest.raises(UserError, match="has changed since"):
            _generate(step, "--tokenizer", str(tok))
        original = tmp_path / "original.json"
        original.write_bytes(content)
        assert _generate(step, "--tokenizer", str(original)).tokenizer_spec == str(original)
        assert "CHANGED since the run" in verify_lines(step)[0][2]
        out, copied, why, _ = export_hf(step, tmp_path / "export")  # before: the edited file copied as its own
        assert copied == [] and "has changed since the run" in why, (copied, why)
    finally:
        tok.write_bytes(content)
    assert "(its content as recorded)" in verify_lines(step)[0][2]


def test_a_checkpoint_without_the_record_keeps_todays_behaviour(tmp_path):
    tok = bpe_tokenizer(tmp_path / "tok.json")
    step = checkpoint(tmp_path, str(tok.resolve()))  # (write_manifest without tokenizer_identity: older)
    assert "tokenizer_identity" not in read_manifest(step)
    moved = tmp_path / "moved.json"
    tok.rename(moved)
    request = _generate(step, "--tokenizer", str(moved))
    assert any("no longer exists" in n for n in request.notes), request.notes


def test_a_latest_of_bytes_that_are_no_utf8_is_a_garbled_latest(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (1, 2):
        (root / f"step-0000000{n}").mkdir(parents=True)
        write_manifest(root / f"step-0000000{n}", step=n, layout={}, model={}, tokenizer="byte")
    (root / "latest").write_text("not-a-step\n")
    garbled = resolve_checkpoint("auto", root)
    (root / "latest").write_bytes(b"\xff\xfe step-00000001\n")  # before: UnicodeDecodeError
    assert resolve_checkpoint("auto", root) == garbled == root / "step-00000002"
    lines, problems = verify_lines(root)
    assert not problems and lines[0].startswith(f"checkpoint {root / 'step-00000002'}")


def _docs(root):
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("the first document, about rivers and the sea.\n" * 3)
    (root / "sub" / "b.txt").write_text("a second one on mountains, snow and ice.\n" * 3)
    return root


@pytest.mark.parametrize("second", ["docs", "docs/", "docs/sub", "docs/sub/b.txt", "./docs/../docs"])
def test_the_same_input_twice_or_one_inside_another_is_refused(tmp_path, monkeypatch, second):
    monkeypatch.chdir(tmp_path)
    _docs(tmp_path / "docs")
    with pytest.raises(DataError) as e:  # before: every document of the overlap stored twice (--dedup none)
        build_store(opts(["docs", second], tmp_path / "store", 32, strategy="concat", dedup="none"), log=quiet)
    msg = str(e.value)
    assert "--input" in msg and f"'{second}'" in msg and "'docs'" in msg, msg
    assert not (tmp_path / "store" / "manifest.json").exists()
    # the inputs one at a time (or side by side) still build, each document once
    built = build_store(opts(["docs/a.txt", "docs/sub"], tmp_path / "ok", 32, strategy="concat", dedup="none"),
                        log=quiet)
    assert built["totals"]["documents"] == 2


def test_an_empty_text_field_is_refused(tmp_path):
    docs = _docs(tmp_path / "docs")
    (docs / "r.jsonl").write_text("".join(json.dumps({"text": f"record {i} of the jsonl file"}) + "\n"
                                          for i in range(3)))
    full = build_store(opts([docs], tmp_path / "full", 32, strategy="concat", dedup="none"), log=quiet)
    assert full["totals"]["documents"] == 5
    with pytest.raises(DataError, match="--text-field '' names no field"):  # before: 2 documents, 3 dropped
        build_store(opts([docs], tmp_path / "empty", 32, strategy="concat", dedup="none", text_field=""),
                    log=quiet)
    shutil.rmtree(tmp_path / "full")
