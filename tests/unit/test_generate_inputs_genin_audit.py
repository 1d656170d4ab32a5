"""`longctx generate`'s inputs and loading as a demanding user meets them (audit "genin"). Each case did
otherwise before it:

- --output was opened (truncated) after the model loaded and written line by line: a run that stopped early
  left FILE holding some lines, read by anyone as the result, and had already destroyed a FILE of an earlier
  run; now the lines go to FILE.partial, renamed FILE once every line is in.
- --output in a directory where no file can be created passed every check and raised from open() after the
  weights were read and warmed up.
- a safetensors file cut short (a partial download) raised safetensors' own traceback at load; a --draft with
  a missing or truncated weight file was found only after the target's weights were read.
- --prompts /dev/stdin or <(...) (a pipe) was refused as "no such file"; a directory too.
- a prompts file with a UTF-8 BOM (Windows editors, PowerShell) was refused as "not JSON".
- an "id" of NaN or Infinity (Python's json reads them) was written as null: the output line lost its id.
"""

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_tokenizer_follows_model import hf_model_dir

from longctx.cli import build_parser
from longctx.config.hf_families import HFFormatError
from longctx.errors import UserError
from longctx.generate.prompts import read_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return hf_model_dir(tmp_path_factory.mktemp("genin") / "hf")


def _args(*argv):
    args, rest = build_parser("generate").parse_known_args(["generate", *map(str, argv)])
    args.argv = ["generate", *map(str, argv)]
    return args, rest


def _prepare(*argv):
    from longctx.generate.cli import prepare

    return prepare(*_args(*argv))


def _prompts_file(path, n):
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "id": i}) + "\n" for i in range(n)))
    return path


def test_a_run_that_stops_early_leaves_no_output_that_reads_as_complete(hf, tmp_path, monkeypatch):
    from longctx import threads
    from longctx.generate import cli, engine

    monkeypatch.setattr(threads, "fit_to_idle_cores", lambda *a, **k: None)
    prompts, out = _prompts_file(tmp_path / "p.jsonl", 3), tmp_path / "out.jsonl"
    out.write_text('{"earlier": "run"}\n')
    real, calls = engine.generate, []

    def failing(*a, **k):  # the warm-up, the first prompt, then the device fails on the second
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real(*a, **k)

    monkeypatch.setattr(engine, "generate", failing)
    argv = ["--checkpoint", f"hf:{hf}", "--prompts", prompts, "--output", out, "--batch", "1", "--max-new-tokens", "2"]
    with pytest.raises(RuntimeError, match="device lost"):
        cli.main(*_args(*argv))
    assert out.read_text() == '{"earlier": "run"}\n'  # (not truncated, not one line posing as the result)
    [line] = Path(f"{out}.partial").read_text().splitlines()
    assert json.loads(line)["id"] == 0
    monkeypatch.setattr(engine, "generate", real)
    assert cli.main(*_args(*argv)) == 0
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [0, 1, 2]
    assert not Path(f"{out}.partial").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no file can be created")
def test_an_output_where_no_file_can_be_created_is_refused_before_the_weights(hf):
    with pytest.raises(UserError) as e:
        _prepare("--checkpoint", f"hf:{hf}", "--prompt", "def f(x):", "--output", "/proc/genin-out.jsonl")
    assert "--output /proc/genin-out.jsonl cannot be written" in " ".join(str(e.value).split())


def test_output_whose_partial_is_the_prompts_file_is_refused(hf, tmp_path):
    prompts = _prompts_file(tmp_path / "out.jsonl.partial", 1)
    with pytest.raises(UserError, match="partial"):
        _prepare("--checkpoint", f"hf:{hf}", "--prompts", prompts, "--output", tmp_path / "out.jsonl")


def test_a_truncated_safetensors_file_is_one_error_naming_it(hf, tmp_path):
    from longctx.models.hf_files import weight_files

    cut = tmp_path / "cut"
    cut.mkdir()
    for f in hf.iterdir():
        (cut / f.name).write_bytes(f.read_bytes())
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(HFFormatError) as e:
        weight_files(cut)
    said = " ".join(str(e.value).split())
    assert str(weights) in said and "cut short" in said
    # as a --draft: refused in prepare, before the target's weights are read (found after them before)
    with pytest.raises(UserError) as e:
        _prepare("--checkpoint", f"hf:{hf}", "--prompt", "def f(x):", "--draft", f"hf:{cut}")
    assert str(weights) in " ".join(str(e.value).split())


def test_a_draft_missing_a_shard_is_refused_before_the_target_is_read(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    draft = tmp_path / "sharded"
    draft.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (draft / name).write_bytes((hf / name).read_bytes())
    state = load_file(str(hf / "model.safetensors"))
    names = sorted(state)
    files = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for f, part in files.items():
        save_file({n: state[n] for n in part}, str(draft / f))
    (draft / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in files.items() for n in part}}))
    _prepare("--checkpoint", f"hf:{hf}", "--prompt", "def f(x):", "--draft", f"hf:{draft}")  # whole: taken
    (draft / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors"):
        _prepare("--checkpoint", f"hf:{hf}", "--prompt", "def f(x):", "--draft", f"hf:{draft}")


def _read(path, nproc=1):
    return read_prompts(SimpleNamespace(prompt=None, prompts=str(path), chat=False, nproc=nproc))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_prompts_from_a_pipe_on_one_process(tmp_path):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)

    def feed():
        with open(pipe, "w") as f:
            f.write('{"prompt": "a", "id": 1}\n{"prompt": "b"}\n')

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        rows = _read(pipe)
    finally:
        if writer.is_alive():  # (a reader that refused the pipe unopened leaves the writer blocked: release it)
            os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=10)
    assert [r["text"] for r in rows] == ["a", "b"]
    # under --nproc every rank reads the file: a pipe is said, not found empty on the other ranks
    with pytest.raises(UserError, match="not a regular file"):
        _read(pipe, nproc=2)
    with pytest.raises(UserError, match="is a directory"):
        _read(tmp_path)


def test_a_prompts_file_with_a_utf8_bom_is_read(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [r["text"] for r in _read(path)] == ["a", "b"]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", '{"k": NaN}'])
def test_an_id_no_json_line_can_carry_is_refused(tmp_path, value):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": ' + value + "}\n")
    with pytest.raises(UserError, match="line 2"):
        _read(path)


def test_the_documented_stop_examples_pass_what_they_mean():
    """`--stop "\\n\\n"` in a shell passes a backslash and an n twice (generate reads no escapes), a stop that never
    ends a row on a blank line (and cuts code at a "\\n" in a string literal): the examples gave it so."""
    import re

    import longctx.generate.cli as cli

    root = Path(__file__).resolve().parents[2]
    for where, text in (("docs/generate.md", (root / "docs" / "generate.md").read_text()),
                        ("generate/cli.py's docstring", cli.__doc__)):
        bad = re.findall(r'--stop "[^"]*\\[^"]*"', text)
        assert not bad, f"{where}: {bad} passes a backslash, not a newline; write --stop $'\\n\\n'"
    assert "$'\\n\\n'" in (root / "docs" / "generate.md").read_text()


def test_output_to_a_device_or_through_a_link_is_written_where_it_points(tmp_path):
    """FILE.partial, renamed: never over /dev/null (a root run replaced the device with a file) nor over a
    link (open() writes the file it names; the rename replaces that file, the link stays)."""
    import stat

    from longctx.data.tokenizer import load_tokenizer
    from longctx.generate.output import Output

    result = SimpleNamespace(tokens=[104, 105], prompt_tokens=1, finish_reason="length", prefill_tokens_per_s=1.0,
                             decode_tokens_per_s=1.0)
    (tmp_path / "real.jsonl").write_text("earlier\n")
    (tmp_path / "link.jsonl").symlink_to("real.jsonl")
    targets = [str(tmp_path / "link.jsonl")] + (["/dev/null"] if Path("/dev/null").exists() else [])
    for target in targets:
        with Output(load_tokenizer("byte"), [], target, 1, 2, True) as out:
            out.write({"text": "x"}, result, speculative=False)
    assert (tmp_path / "link.jsonl").is_symlink() and json.loads((tmp_path / "real.jsonl").read_text())["text"] == "hi"
    assert not list(tmp_path.glob("*.partial"))
    if Path("/dev/null").exists():
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and not Path("/dev/null.partial").exists()


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444])
def test_an_existing_output_keeps_its_permissions(tmp_path, mode):
    """FILE.partial renamed over an existing FILE: the file published had the new file's permissions (0666 &
    ~umask), where the write in place before kept FILE's: a private 0600 output became world-readable 0644."""
    import stat

    from longctx.data.tokenizer import load_tokenizer
    from longctx.generate.output import Output

    result = SimpleNamespace(tokens=[104, 105], prompt_tokens=1, finish_reason="length", prefill_tokens_per_s=1.0,
                             decode_tokens_per_s=1.0)
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    out.chmod(mode)
    umask = os.umask(0o022)
    try:
        for _ in range(2):  # (a read-only FILE: its FILE.partial stays writable to the next run's open)
            with pytest.raises(RuntimeError), Output(load_tokenizer("byte"), [], str(out), 1, 2, True) as o:
                raise RuntimeError("stopped")
            assert o.partial.endswith(".partial") and os.stat(o.partial).st_mode & stat.S_IWUSR
        with Output(load_tokenizer("byte"), [], str(out), 1, 2, True) as o:
            o.write({"text": "x"}, result, speculative=False)
    finally:
        os.umask(umask)
    assert json.loads(out.read_text())["text"] == "hi" and stat.S_IMODE(out.stat().st_mode) == mode


@pytest.mark.skipif(not (Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK)), reason="needs /dev/shm")
def test_an_output_on_dev_shm_is_written_as_a_partial_file(tmp_path):
    """/dev/shm holds files (tmpfs), not devices: an --output there was written in place like /dev/null, so a run
    that stopped early had truncated the earlier output and left a half one that read as complete."""
    import uuid

    from longctx.data.tokenizer import load_tokenizer
    from longctx.durable import check_output_path, written_in_place
    from longctx.generate.output import Output

    out = Path(f"/dev/shm/longctx-genin-{uuid.uuid4().hex[:8]}.jsonl")
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    try:
        out.write_text('{"earlier": "run"}\n')
        assert not written_in_place(out) and not written_in_place(link) and written_in_place("/dev/null")
        check_output_path("--output", str(out), {})
        with pytest.raises(RuntimeError), Output(load_tokenizer("byte"), [], str(link), 2, 2, True):
            raise RuntimeError("device lost")
        assert out.read_text() == '{"earlier": "run"}\n' and Path(f"{out}.partial").is_file() and link.is_symlink()
    finally:
        out.unlink(missing_ok=True)
        Path(f"{out}.partial").unlink(missing_ok=True)
