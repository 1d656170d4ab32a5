"""`longctx eval --mode generate` with longctx generate's sampling flags: each sequence draws from its
own seed (--seed and its length, depth and sample), so the answers are the same at --batch 1 and 4; the
settings are in the JSON; the flags are refused under --mode score and out of range, before work. The two
sampled runs are in this process (test_newcomer.longctx_here: they are compared by their JSON, and a new
interpreter's imports cost seconds a run); the refusals are real subprocesses."""

import json
import sys
import sysconfig
from pathlib import Path

import pytest
from test_newcomer import longctx, longctx_here

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_hf  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

EVAL = ["--task", "passkey", "--lengths", "128", "--depths", "0,1", "--samples", "2", "--mode", "generate"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d, _ = test_hf.random_hf_dir(tmp_path_factory.mktemp("hf"), test_hf.hf_config("llama", eos_token_id=0))
    bpe_tokenizer(d / "tokenizer.json")
    return d


@pytest.fixture(scope="module")
def filler(tmp_path_factory):
    """The passkey filler as a text file (about 60 KB of the standard library, as test_eval_cli's): without
    --data eval builds the default corpus's store with this model's tokenizer first, most of the test's time."""
    root = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("text") / "long.py"
    path.write_text("".join((root / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")))
    return path


def test_sampled_answers_do_not_depend_on_the_batch(hf_dir, filler, tmp_path):
    runs = {}
    for batch in (1, 4):
        out = tmp_path / f"{batch}.json"
        r = longctx_here("eval", "--checkpoint", f"hf:{hf_dir}", *EVAL, "--data", str(filler),
                         "--temperature", "1.0", "--min-p", "0.01",
                         "--repetition-penalty", "1.1", "--batch", str(batch), "--output", str(out))
        assert r.returncode == 0, r.stderr
        runs[batch] = json.loads(out.read_text())
    assert runs[1]["sampling"]["temperature"] == 1.0 and runs[1]["sampling"]["min_p"] == 0.01
    generated = [[r["generated"] for r in runs[b]["results"]] for b in (1, 4)]
    assert generated[0] == generated[1]
    assert len({g for per_depth in generated[0] for g in per_depth}) == 4  # four requests, four streams


@pytest.mark.parametrize("args, message", [
    (["--mode", "score", "--temperature", "1"], "--temperature applies to --mode generate"),
    (EVAL + ["--min-p", "2"], "--min-p must be in [0, 1]"),
    (EVAL + ["--repetition-penalty", "-1"], "--repetition-penalty must be > 0"),
])
def test_bad_sampling_flags_are_refused_before_work(hf_dir, args, message):
    base = ["--task", "passkey", "--lengths", "128"] if args[0] == "--mode" else []
    r = longctx("eval", "--checkpoint", f"hf:{hf_dir}", *base, *args)
    assert r.returncode != 0 and message in r.stderr, r.stderr
