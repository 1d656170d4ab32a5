"""`longctx eval --samples 0` (a helper's audit, 2026-12-05): zero samples was read as "the task's default" (the
flag's default was 0, the sentinel for it), so a run asked for no sequences silently scored 8 ppl spans or 5
prompts per depth and wrote their figures. It is refused before any work, as a negative count is; leaving the
flag out still gives the defaults."""

import pytest

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.eval.request import prepare
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(an hf:DIR of a random one-layer model, a text file)."""
    tmp = tmp_path_factory.mktemp("zerosamples")
    hf = save_hf(build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1),
                 tmp / "hf")
    text = tmp / "doc.py"
    text.write_text(TEXT)
    return hf, text


def _prepare(folder, task: str, *extra):
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--lengths", "384",
         "--data", str(text), *extra])
    return prepare(args, rest, 1)


@pytest.mark.parametrize("task", ["ppl", "passkey", "needle"])
def test_zero_samples_is_refused_before_work(folder, task):
    with pytest.raises(ConfigError, match="--samples must be positive, got 0"):
        _prepare(folder, task, "--samples", "0")


def test_without_the_flag_each_task_keeps_its_default(folder):
    assert _prepare(folder, "passkey", "--depths", "0,1").sequences.counts == {384: 10}  # 5 per depth
    assert _prepare(folder, "ppl").sequences.counts == {384: 7}  # (8 asked; the text holds 7 spans of 384)
