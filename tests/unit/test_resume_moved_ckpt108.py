"""A run whose checkpoint disk filled goes on with a new --checkpoint.dir, resuming from its last checkpoint in the
old one: refused as "a checkpoint of another run" (only checkpoints under the new checkpoint.dir or the run
directory counted as the run's), though the checkpoint's manifest names this run directory as its run's. A
checkpoint another run saved is still refused."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.train.trainer import train

ARGS = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1",
        "--checkpoint.interval=2", "--checkpoint.async=false"]


def _train(run_dir, ckpt_dir, steps, resume="auto"):
    return train(load_config(None, [*ARGS, f"--train.steps={steps}", f"--train.run_dir={run_dir}",
                                    f"--checkpoint.dir={ckpt_dir}", f"--checkpoint.resume={resume}"]),
                 log=lambda *a, **_: None)


def test_a_run_resumes_from_its_checkpoint_in_an_earlier_checkpoint_dir(tmp_path):
    run = tmp_path / "run"
    _train(run, tmp_path / "disk1", 2)
    result = _train(run, tmp_path / "disk2", 4, resume=str(tmp_path / "disk1" / "step-00000002"))
    assert result.first_step == 3 and len(result.losses) == 2
    assert (tmp_path / "disk2" / "step-00000004" / "manifest.json").is_file()


def test_a_checkpoint_of_another_run_is_still_refused(tmp_path):
    _train(tmp_path / "other", tmp_path / "disk1", 2)
    _train(tmp_path / "run", tmp_path / "disk2", 2)
    with pytest.raises(ConfigError, match="names a checkpoint of another run"):
        _train(tmp_path / "run", tmp_path / "disk3", 4, resume=str(tmp_path / "disk1" / "step-00000002"))
