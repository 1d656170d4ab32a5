"""`longctx eval` as a user runs it: on a checkpoint of a tiny run, one process and head 2 x ctx 2 alike,
and its bad input explained before any rank starts (--mode generate: tests/e2e/test_eval_generate.py).
The one-process commands run in this process (longctx_here: a new interpreter's imports cost seconds each and
these tests read what the command writes, not how its process ends); `--nproc 4` keeps the real launch."""

import json
import sysconfig
from pathlib import Path

import pytest
from test_newcomer import flat, longctx, longctx_here

RUN = ["--train.seq_len=128", "--data.max_docs=100", "--train.eval_interval=0", "--metrics.log_interval=2",
       "--model.layers=2", "--train.steps=4", "--train.global_batch=2", "--checkpoint.interval=4",
       "--data.synthetic=passkey:0.5", "--metrics.plots=false", "--metrics.progress=false"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    r = longctx_here("train", "--nproc", "1", *RUN, f"--train.run_dir={run}")
    assert r.returncode == 0, r.stderr
    assert "training samples are passkey sequences" in r.stdout
    return run / "checkpoints"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """About 60 KB of the standard library: a long document for ppl and filler."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((root / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py"))
    path = tmp_path_factory.mktemp("text") / "long.py"
    path.write_text(text)
    return path


def _eval(checkpoint, out, *args, nproc=1):
    """The JSON of `longctx eval`: one process in this one, more through the launcher (a subprocess)."""
    run = longctx_here if nproc == 1 else longctx
    r = run("eval", "--checkpoint", str(checkpoint), "--output", str(out), "--nproc", str(nproc), *args)
    assert r.returncode == 0, r.stderr
    return json.loads(Path(out).read_text())


def test_checkpoint_records_its_tokenizer(checkpoint):
    manifest = json.loads((checkpoint / (checkpoint / "latest").read_text().strip() / "manifest.json").read_text())
    assert manifest["tokenizer"] == "byte"


def test_eval_is_the_same_under_head_2_x_ctx_2(checkpoint, text_file, tmp_path):
    """Layout parity: per-bucket losses within 1e-5 and the same passkey answers as one process. ppl and
    passkey share each launch (--task ppl,passkey: each task's part is what it alone writes,
    tests/e2e/test_eval_task_list.py), so the weights are read twice, not four times."""
    both = ["--task", "ppl,passkey", "--lengths", "256,512", "--data", str(text_file), "--samples", "3", "--buckets",
            "8", "--depths", "0,0.5,1"]
    ones = _eval(checkpoint, tmp_path / "one.json", *both)["tasks"]
    fours = _eval(checkpoint, tmp_path / "four.json", *both, nproc=4)["tasks"]
    one, four = ones["ppl"], fours["ppl"]
    assert four["layout"]["head"] == 2 and four["layout"]["ctx"] == 2
    assert (tmp_path / "one.ppl.png").is_file()
    for a, b in zip(one["results"], four["results"]):
        assert a["length"] == b["length"] and a["tokens"] == b["tokens"] > 0
        for x, y in zip(a["buckets"], b["buckets"]):
            assert x["tokens"] == y["tokens"]
            assert abs(x["loss"] - y["loss"]) < 1e-5, (a["length"], x, y)
    one, four = ones["passkey"], fours["passkey"]
    assert (tmp_path / "one.passkey.png").is_file()
    assert [r["per_sample"] for r in one["results"]] == [r["per_sample"] for r in four["results"]]
    for a, b in zip(one["results"], four["results"]):
        assert abs(a["answer_nll"] - b["answer_nll"]) < 1e-5
    assert len(one["results"]) == 6 and {r["samples"] for r in one["results"]} == {3}


def test_needle_and_default_corpus(checkpoint, tmp_path):
    out = _eval(checkpoint, tmp_path / "n.json", "--task", "needle", "--lengths", "512", "--depths", "0.5",
                "--samples", "2")
    assert out["task"] == "needle" and "stdlib" in out["data"] and 0 <= out["accuracy"] <= 1


@pytest.mark.parametrize("args, needle", [
    (["--task", "passkey", "--lengths", "1001", "--nproc", "4"], "--lengths: sequence length 1001 is not divisible"),
    (["--task", "passkey", "--lengths", "256", "--depths", "0,1.5"], "outside [0, 1]"),
    (["--task", "passkey", "--lengths", "64"], "no room for filler"),
    (["--task", "ppl", "--lengths", "256", "--data.path=x"], "does not apply"),
    (["--task", "ppl", "--lengths", "256", "--data", "/no/such/file"], "is neither a store directory nor a text file"),
    (["--task", "ppl", "--lengths", "256", "--mode", "generate"], "--task ppl asks none"),
    (["--task", "passkey", "--lengths", "256", "--mode", "generate", "--nproc", "4", "--parallel.ctx", "2"],
     "needs --parallel.head x --parallel.ctx = 4 (the layout is data-parallel 2 x head 1 x ctx 2)"),
    (["--task", "needle", "--lengths", "256", "--mode", "generate", "--nproc", "2", "--parallel.dp_shard", "2"],
     "generation shards the KV cache over head x ctx ranks and every rank holds the full weights"),
    (["--task", "passkey", "--lengths", "256", "--mode", "sample"], "invalid choice: 'sample'"),
])
def test_bad_input_is_explained_before_work(checkpoint, args, needle):
    r = longctx_here("eval", "--checkpoint", str(checkpoint), *args)
    assert r.returncode == 2, r.stderr
    assert needle in flat(r.stderr) and "Traceback" not in r.stderr


def test_a_model_without_tokenizer_cannot_read_text(checkpoint, text_file, tmp_path):
    out = tmp_path / "hf"
    r = longctx_here("checkpoint", "export", str(checkpoint), str(out))
    assert r.returncode == 0, r.stderr
    r = longctx_here("eval", "--checkpoint", f"hf:{out}", "--task", "passkey", "--lengths", "256")
    assert r.returncode == 2
    assert "has no tokenizer.json" in flat(r.stderr) and "--tokenizer byte" in flat(r.stderr)
    # (the filler from a text file: the default corpus is test_needle_and_default_corpus's, and building the
    # whole standard library's store at 256 tokens for one prompt took 15 of this test's 27 s)
    ok = longctx_here("eval", "--checkpoint", f"hf:{out}", "--task", "passkey", "--lengths", "256", "--samples", "1",
                      "--depths", "0", "--tokenizer", "byte", "--data", str(text_file))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["results"][0]["samples"] == 1


def test_training_starts_from_a_longctx_checkpoint_with_a_new_rope_base(checkpoint, tmp_path):
    """model.init_from = a checkpoint directory: its [model], its weights, the extension on top."""
    r = longctx_here("train", "--nproc", "1", *RUN, f"--train.run_dir={tmp_path / 'ext'}",
                     f"--model.init_from={checkpoint}", "--model.rope_theta=40000", "--train.steps=2",
                     "--data.synthetic=")
    assert r.returncode == 0, r.stderr
    assert "model.rope_theta: 10000.0 -> 40000.0" in r.stdout
    bad = longctx_here("train", "--nproc", "1", *RUN, f"--model.init_from={checkpoint}", "--model.dim=256")
    assert bad.returncode == 2
    assert "model.dim=256 contradicts the weights" in flat(bad.stderr)
