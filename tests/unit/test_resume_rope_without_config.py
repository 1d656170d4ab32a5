"""A resume whose run directory (its config.toml, which config/resume.py compares the command line against) is
gone builds its config from the defaults and the command line. The checkpoint's manifest records the RoPE it
trained with; only the tensor shapes were compared, so a yarn-extended checkpoint resumed without the yarn flags
continued under plain RoPE without a word (repro_resume_rope.py). Now refused before any rank starts, naming the
settings and the flags that restore them; --checkpoint.allow_changes true still changes them on purpose."""

import pytest

from longctx.checkpoint.manifest import write_manifest
from longctx.config import load_config
from longctx.config.load import to_dict
from longctx.errors import ConfigError
from longctx.train.preflight import _check_resume

SHAPE = ["--model.layers=2", "--model.dim=64", "--model.ffn_dim=128", "--train.seq_len=128"]
YARN = ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=64"]


@pytest.fixture
def copied_checkpoint(tmp_path):
    """A yarn x 4 checkpoint copied away from its run directory (no config.toml above it)."""
    step = tmp_path / "copy" / "step-00000002"
    step.mkdir(parents=True)
    model = to_dict(load_config(overrides=SHAPE + YARN))["model"]
    write_manifest(step, step=2, layout={}, model=model, tokenizer="byte", run_dir=str(tmp_path / "gone"))
    return step


def _resume(tmp_path, step, *flags):
    _check_resume(load_config(overrides=SHAPE + [f"--train.run_dir={tmp_path}/resumed",
                                                 f"--checkpoint.resume={step}", *flags]))


@pytest.mark.parametrize("flags, named", [
    ([], "model.rope_scaling 'yarn' in the checkpoint vs 'none' configured"),
    (["--model.rope_scaling=yarn", "--model.rope_factor=8", "--model.rope_original_max_len=64"],
     "model.rope_factor 4.0 in the checkpoint vs 8.0 configured"),
    (YARN + ["--model.rope_theta=50000"], "model.rope_theta 10000.0 in the checkpoint vs 50000.0 configured"),
    (["--model.rope_scaling=linear", "--model.rope_factor=4"], "model.rope_scaling 'yarn'"),
])
def test_another_rope_is_refused(tmp_path, copied_checkpoint, flags, named):
    with pytest.raises(ConfigError, match="another RoPE") as e:
        _resume(tmp_path, copied_checkpoint, *flags)
    message = " ".join(str(e.value).split())
    assert named in message and "--checkpoint.allow_changes true" in message


def test_the_checkpoints_rope_or_an_asked_change_resumes(tmp_path, copied_checkpoint):
    _resume(tmp_path, copied_checkpoint, *YARN)
    _resume(tmp_path, copied_checkpoint, *YARN, "--model.rope_beta_slow=1")  # (the default, said again)
    _resume(tmp_path, copied_checkpoint, "--checkpoint.allow_changes=true")
