"""Leftovers noticed late in session 117: a DTS-Gate run resumed into or past its schedule was counted (host budget,
memory.offload_fraction auto) at step 0's E experts per token; the hierarchical check under DTS counted at top_k;
`longctx verify` / `export` quietly used another step where `latest` names one moved aside; a UTF-16 .jsonl read
as thousands of bad lines and a CR-only one as one."""

import json

import pytest

from longctx.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


# -- 1. a resumed DTS-Gate run is counted from the step it resumes at ------------------------------------------------

DTS = ["--model.preset=debug-moe", "--model.moe.router=dts", "--model.moe.experts=8", "--model.moe.top_k=2",
       "--model.moe.dts_steps=10", "--model.moe.dense_layers=0", "--train.steps=30", "--train.seq_len=256",
       "--train.device=cpu", "--memory.recompute=none"]


def _saved_at(tmp_path, step: int):
    """A checkpoint directory whose manifest says `step` (all the count reads of it)."""
    path = tmp_path / f"step-{step:08d}"
    path.mkdir()
    (path / "manifest.json").write_text(json.dumps({"format": 1, "step": step}))
    return path


def host_total(base: list[str], *overrides) -> float:
    """One rank's counted host bytes (train/host_budget.py rank_host_bytes) of the config `base` + `overrides`."""
    from longctx.job.checks import check_layout
    from longctx.train.host_budget import rank_host_bytes
    cfg = load_config(None, [*base, *overrides])
    return rank_host_bytes(cfg, check_layout(cfg, 1), "cpu", 1, 1e12)["total"]


def _host_total(*overrides) -> float:
    return host_total(DTS, *overrides)


def test_a_resume_past_the_schedule_is_counted_at_top_k(tmp_path):
    fresh = _host_total()
    at_top_k = _host_total("--model.moe.dts_steps=0")  # (the schedule over at step 0: every step routes top_k)
    past = _host_total(f"--checkpoint.resume={_saved_at(tmp_path, 20)}")  # steps 21..30 route top_k
    assert fresh > at_top_k
    assert past == at_top_k, (past, at_top_k, fresh)


def test_a_resume_inside_the_schedule_is_counted_at_its_first_step(tmp_path):
    from longctx.memory.peak_routing import from_step, peak_top_k
    from longctx.models.moe import scheduled_experts
    cfg = load_config(None, DTS)
    assert [peak_top_k(from_step(cfg.model, s)) for s in (0, 1, 5, 9, 10, 20)] == \
        [8, scheduled_experts(8, 2, 1, 10), 5, scheduled_experts(8, 2, 9, 10), 2, 2]
    mid = _host_total(f"--checkpoint.resume={_saved_at(tmp_path, 5)}")
    assert _host_total() > mid > _host_total("--model.moe.dts_steps=0")


def test_auto_offload_counts_a_resume_from_its_step(tmp_path, monkeypatch):
    import torch

    from longctx.job.runtime import Runtime
    from longctx.memory import auto
    from longctx.memory.peak_routing import peak_top_k
    from longctx.train.model import _offload_for_shape
    seen = []
    monkeypatch.setattr(auto, "choose_offload_fraction", lambda m, *a, **k: seen.append(m) or (0.5, "why"))
    cfg = load_config(None, [*DTS, "--memory.offload_fraction=auto", "--memory.recompute=selective",
                             f"--checkpoint.resume={_saved_at(tmp_path, 20)}", "--train.global_batch=1"])
    _offload_for_shape(cfg, torch.device("cpu"), Runtime.create(cfg, 0, 1, "cpu"), 256, 1, 1e9, 1e12)
    assert [peak_top_k(m) for m in seen] == [2]


# -- 2. the hierarchical check's level bytes under DTS: at the widest step ------------------------------------------

def test_hier_level_bytes_count_a_dts_run_at_its_widest_step():
    from longctx.config import ModelConfig
    from longctx.memory.peak_routing import at_top_k
    from longctx.planner.validate_hier import level_bytes_at
    m = ModelConfig(preset="debug-moe", dim=32, moe_experts=8, moe_top_k=2, moe_router="dts", moe_dts_steps=10)
    fig = {"sent_remote": 100, "received_remote": 90, "pairs_out": 70, "pairs_in": 60, "layers": 2}
    got = level_bytes_at(m, fig, 4, 2, 4)
    # step 0 (the case's: no optimizer step moves its routers) sends each row with 8 expert ids (int64) and 8
    # weights (fp32), and takes back 8 weights' gradients: 12 E and 4 E bytes a row, not 12 top_k and 4 top_k
    d = 2 * 32 * 4
    assert got["expert_node"]["expert_node"] == 100 * (d + 12 * 8) + 90 * (d + 4 * 8)
    assert got == level_bytes_at(at_top_k(m, 8), fig, 4, 2, 4)
    assert level_bytes_at(ModelConfig(**{**vars(m), "moe_dts_steps": 0}), fig, 4, 2, 4)["expert_node"] != got[
        "expert_node"]  # (a schedule over at step 0 routes top_k: the count follows it)


# -- 3. verify / export where `latest` names a step moved aside ------------------------------------------------------

@pytest.fixture(scope="module")
def moved_run(tmp_path_factory):
    """A checkpoints directory whose `latest` names step 4, which a killed re-save left moved aside (what
    tests/unit/test_moved_aside117.py reproduces with a real kill: the step renamed, `latest` unchanged)."""
    from longctx.train.trainer import Trainer
    run_dir = tmp_path_factory.mktemp("left118") / "run"
    cfg = load_config(None, ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
                             "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                             "--train.device=cpu", "--model.layers=1", "--checkpoint.interval=2", "--train.steps=4",
                             f"--train.run_dir={run_dir}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    root = run_dir / "checkpoints"
    old = root / ".tmp-old-step-00000004-0123abcd"
    (root / "step-00000004").rename(old)
    assert (root / "latest").read_text().strip() == "step-00000004"
    return root, old


def test_verify_names_the_moved_aside_step_it_passed_over(moved_run):
    from longctx.checkpoint.verify_command import verify_lines
    root, old = moved_run
    before = sorted(p.name for p in root.iterdir())
    lines, problems = verify_lines(root)
    assert not problems and lines[0].startswith(f"checkpoint {root / 'step-00000002'}")
    note = lines[1]
    assert note.startswith("note: checked step-00000002, the newest complete step, not the one `latest` names"), note
    assert "names step-00000004, which a re-save of that step that did not commit left moved aside as" in note
    assert f"To read step-00000004 instead, pass {old}" in note and f"mv {old} {root / 'step-00000004'}" in note
    assert lines[-1].startswith("OK: step 2")
    assert sorted(p.name for p in root.iterdir()) == before  # (read-only: nothing renamed)
    assert verify_lines(old)[0][-1].startswith("OK: step 4")  # the way the note gives reads step 4


def test_export_names_the_moved_aside_step_it_passed_over(moved_run, tmp_path, capsys):
    from longctx.cli import main
    root, old = moved_run
    assert main(["checkpoint", "export", str(root), str(tmp_path / "hf"), "--to", "hf"]) == 0
    out = capsys.readouterr().out
    assert (f"from {root} (step 2, the newest complete one: its `latest` names step-00000004, which a re-save of "
            f"that step that did not commit left moved aside as {old}. To read step-00000004 instead, pass {old}") \
        in out, out
    assert main(["checkpoint", "export", str(old), str(tmp_path / "hf4"), "--to", "hf"]) == 0
    assert "(step 4" in capsys.readouterr().out


# -- 4. a .jsonl in UTF-16 / UTF-32, or with CR-only line ends --------------------------------------------------------

RECORDS = [{"text": f"document {i} " + "word " * 40} for i in range(300)]


def _records(end: str = "\n") -> str:
    return "".join(json.dumps(r) + end for r in RECORDS)


def test_a_utf16_jsonl_is_one_skipped_file_that_says_how_to_convert_it(tmp_path):
    from longctx.data.builder.options import BuildOptions
    from longctx.data.builder.pipeline import build_store
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "ok.jsonl").write_text(_records()[:20_000].rpartition("\n")[0] + "\n")
    (tmp_path / "in" / "windows.jsonl").write_bytes(_records("\r\n").encode("utf-16"))  # (PowerShell's `>`)
    log: list[str] = []
    build_store(BuildOptions(inputs=[str(tmp_path / "in")], out=str(tmp_path / "out"), seq_len=256, progress=False,
                             workers=1), log=log.append)
    (done,) = [line for line in log if line.startswith("data build: wrote")]
    assert "1 skipped: 1 UTF-16 .jsonl file (convert it to UTF-8: iconv -f UTF-16 -t UTF-8 IN > OUT" in done, done
    assert any("UTF-16/32 input file(s)" in line and "windows.jsonl" in line for line in log), log
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    counts = manifest["parts"][0]["counts"]
    assert counts["skipped"] == {"utf16_file": 1} and counts["damaged_files"] == ["windows.jsonl"], counts


@pytest.mark.parametrize("encoding, reason", [("utf-16-le", "utf16_file"), ("utf-16-be", "utf16_file"),
                                              ("utf-32", "utf32_file"), ("utf-32-be", "utf32_file")])
def test_utf16_and_utf32_without_or_with_a_mark_are_one_skip(tmp_path, encoding, reason):
    from collections import Counter

    from longctx.data.builder import readers
    path = tmp_path / "x.jsonl"
    path.write_bytes(_records().encode(encoding))
    skipped, damaged = Counter(), []
    assert list(readers.iter_file(path, "x.jsonl", "text", skipped, damaged)) == []
    assert skipped == Counter({reason: 1}) and damaged == ["x.jsonl"]
    assert "UTF-32" in readers.skipped_text({"utf32_file": 1}) and "-f UTF-32" in readers.skipped_text(
        {"utf32_file": 1})


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_a_cr_only_jsonl_reads_a_document_a_line(tmp_path, monkeypatch, chunk):
    from collections import Counter

    from longctx.data.builder import readers
    monkeypatch.setattr(readers, "CHUNK", chunk)
    records = RECORDS[:6] if chunk < 100 else RECORDS
    lf = "".join(json.dumps(r) + "\n" for r in records)

    def read(raw: bytes, name: str):
        (tmp_path / name).write_bytes(raw)
        skipped = Counter()
        docs = [(d.name.rpartition(":")[2], d.text) for d in readers.iter_file(tmp_path / name, name, "text", skipped)]
        return docs, skipped

    want, none = read(lf.encode(), "lf.jsonl")
    assert len(want) == len(records) and not none
    for name, raw in [("mac.jsonl", lf.replace("\n", "\r")), ("crlf.jsonl", lf.replace("\n", "\r\n")),
                      ("mac_no_end.jsonl", lf.replace("\n", "\r").rstrip("\r")), ("blank.jsonl", "\r" + lf.replace(
                          "\n", "\r"))]:
        docs, skipped = read(raw.encode(), name)
        shift = 1 if name == "blank.jsonl" else 0  # (a blank first line: the names count it, as under LF)
        assert docs == [(str(int(n) + shift), t) for n, t in want] and not skipped, (name, skipped)
    # a record whose white space holds a CR, in an LF file, is still one record (its first line ends in LF)
    docs, skipped = read(b'{"text":\r"x"}\n{"text": "y"}\n', "ws.jsonl")
    assert [t for _, t in docs] == ["x", "y"] and not skipped
