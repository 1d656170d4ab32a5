"""Review of the session-118 leftovers (b3b98225): a resumed DTS-Gate run's memory counts, the moved-aside notes of
verify / export / generate / eval, the UTF-16 / UTF-32 .jsonl skip.

1. `--checkpoint.resume auto` passes over a checkpoint whose files are damaged (only their checksums tell, as it
   loads) for the one before it; counted at the newest (train/host_budget.py counted_model), a fallback from step 4
   to step 2 ran 5 experts per token where the host budget and memory.offload_fraction auto counted 2.
2. A checkpoints directory whose `latest` names a step moved aside by a killed re-save, with no other complete step:
   verify, export, generate / eval said "holds no complete checkpoint" and nothing of the whole step beside it.
3. The iconv hint of a UTF-16 / UTF-32 .jsonl without a byte-order mark said -f UTF-16LE / UTF-32LE, which garbles
   a big-endian file (glibc's -f UTF-16 reads one without a mark as the machine's order, little-endian here too).
4. An LF .jsonl whose first line, longer than the 1 MiB look-ahead, held a CR was read at CR alone: every record
   after it one bad line (the commit's CR-only reading; before it, all were read).
"""

import json
import shutil
import subprocess

import pytest

from longctx.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

DTS_RUN = ["--model.preset=debug-moe", "--model.moe.router=dts", "--model.moe.experts=8", "--model.moe.top_k=2",
           "--model.moe.dts_steps=4", "--model.moe.dense_layers=", "--model.layers=1", "--train.seq_len=64",
           "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false",
           "--metrics.progress=false", "--train.device=cpu", "--checkpoint.interval=2"]


def test_resume_auto_is_counted_at_the_oldest_checkpoint_it_may_load(tmp_path):
    from longctx.memory.peak_routing import from_step, peak_top_k
    from longctx.train.host_budget import counted_model
    from longctx.train.trainer import Trainer
    run = [*DTS_RUN, f"--train.run_dir={tmp_path / 'run'}"]
    Trainer(load_config(None, [*run, "--train.steps=4"]), log=lambda *a, **k: None).run()
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000004"]
    shards = [p for p in (root / "step-00000004").iterdir() if p.suffix == ".distcp"]
    shard = max(shards, key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # (its manifest still reads: only the checksum, at the load, finds it)
    shard.write_bytes(bytes(data))
    cfg = load_config(None, [*run, "--train.steps=5", "--checkpoint.resume=auto"])
    counted = peak_top_k(counted_model(cfg))
    said: list[str] = []
    result = Trainer(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a)))).run()
    assert any("resuming from step-00000002" in line for line in said), said
    routed = peak_top_k(from_step(cfg.model, result.first_step - 1))  # (optimizer step 2, 0-based: step 3's)
    assert (result.first_step, routed) == (3, 5)
    assert counted >= routed, (counted, routed)  # (was 2: counted at step 4, past the schedule)


def _only_step_moved_aside(tmp_path):
    """A checkpoints directory whose `latest` names step 4, left moved aside by a killed re-save (the rename alone:
    what the read-only commands look at), with no other complete step."""
    root = tmp_path / "checkpoints"
    old = root / ".tmp-old-step-00000004-0123abcd"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"format": 1, "step": 4, "model": {}}))
    (root / "latest").write_text("step-00000004\n")
    return root, old


@pytest.mark.parametrize("given", ["dir", "latest"])
def test_a_checkpoints_directory_whose_only_step_is_moved_aside_says_where_it_is(tmp_path, given):
    from longctx.checkpoint.export import export_hf
    from longctx.checkpoint.verify_command import verify_lines
    from longctx.config.checkpoint_paths import CheckpointError, check_weights_flag
    from longctx.errors import ConfigError
    root, old = _only_step_moved_aside(tmp_path)
    spec = str(root if given == "dir" else root / "latest")
    note = f"step-00000004 is whole, but moved aside as {old}"
    with pytest.raises(CheckpointError) as verify:
        verify_lines(spec)
    with pytest.raises(ConfigError) as weights:  # generate and eval's --checkpoint
        check_weights_flag(spec)
    with pytest.raises(CheckpointError) as export:
        export_hf(spec, tmp_path / "hf")
    for e in (verify, weights, export):
        assert note in str(e.value) and f"mv {old} {root / 'step-00000004'}" in str(e.value), str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [".tmp-old-step-00000004-0123abcd", "latest"]  # (nothing moved)


@pytest.mark.parametrize("encoding, reason, order", [("utf-16-be", "utf16_file", "UTF-16BE"),
                                                     ("utf-32-be", "utf32_file", "UTF-32BE")])
def test_the_iconv_hint_names_the_order_of_a_big_endian_file_without_a_mark(tmp_path, encoding, reason, order):
    from collections import Counter

    from longctx.data.builder import readers
    path = tmp_path / "x.jsonl"
    path.write_bytes('{"text": "a"}\n{"text": "b"}\n'.encode(encoding))
    skipped = Counter()
    assert list(readers.iter_file(path, "x.jsonl", "text", skipped)) == [] and skipped == Counter({reason: 1})
    assert path.read_bytes()[0] == 0
    hint = readers.skipped_text(dict(skipped))
    assert f"-f {order} where its first byte is 0" in hint, hint
    if shutil.which("iconv") is None:
        return
    converted = subprocess.run(["iconv", "-f", order, "-t", "UTF-8", str(path)], capture_output=True, check=True)
    assert converted.stdout == b'{"text": "a"}\n{"text": "b"}\n'
    little = order.replace("BE", "LE")  # (what the hint said: garbles it, or fails)
    wrong = subprocess.run(["iconv", "-f", little, "-t", "UTF-8", str(path)], capture_output=True)
    assert wrong.stdout != converted.stdout


@pytest.mark.parametrize("compress", [False, True])
def test_an_lf_file_whose_long_first_line_holds_a_cr_keeps_its_records(tmp_path, compress):
    """A CR (JSON white space) in a first line longer than the look-ahead (1 MiB: a long-context corpus holds such
    documents) with no LF before it read the LF file at CR alone: every record after the first was one bad line.
    Split at its LFs too, only the record that held the CR is lost (read at CR, its pieces are bad lines)."""
    import gzip
    from collections import Counter

    from longctx.data.builder import readers
    first = '{"id": 0,\r"text": "' + "long " * (1 << 18) + '"}\n'  # (valid JSON, 1.25 MiB; the CR in its first MiB)
    rest = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(1, 40))
    raw = (first + rest).encode()
    path = tmp_path / ("x.jsonl.gz" if compress else "x.jsonl")
    path.write_bytes(gzip.compress(raw) if compress else raw)
    skipped = Counter()
    texts = [d.text for d in readers.iter_file(path, path.name, "text", skipped)]
    assert texts[-39:] == [f"record {i}" for i in range(1, 40)], (len(texts), skipped)
    assert sum(skipped.values()) <= 2, skipped
