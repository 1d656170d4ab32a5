"""train.deterministic (job/devices.py use_deterministic_algorithms): the Trainer switches torch to its
deterministic kernels before the job starts (torch.use_deterministic_algorithms, cuDNN deterministic
without autotuning, cuBLAS's deterministic workspace: the environment's when it is one of the two, refused
when it is another), says so in its setup line, and an MoE run trains under the mode; without the flag the
process's settings are left as they are. On a CPU the mode refuses no op on the training path and the losses
repeat with or without it: what the mode changes on a GPU is run by benchmarks/gpu_speed.sh step 6."""

import os

import pytest
import torch

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.train.trainer import Trainer

BASE = ["--model.preset=debug-moe", "--model.layers=2", "--train.seq_len=64", "--train.global_batch=2",
        "--train.steps=3", "--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false",
        "--metrics.progress=false", "--train.device=cpu", "--checkpoint.final=false"]


@pytest.fixture
def restored():
    """Torch's process-wide settings as they were before the test."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
              torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[4])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


def _trained(tmp_path, name, *extra):
    lines = []
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={tmp_path / name}", *extra]), log=lines.append)
    state = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    return trainer.run().losses, state, "\n".join(map(str, lines))


def test_the_flag_switches_torch_to_deterministic_kernels_and_an_moe_run_trains_under_them(tmp_path, restored):
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    losses, state, log = _trained(tmp_path, "a", "--train.deterministic=true")
    assert state == (True, True, False, ":4096:8")
    assert "deterministic kernels (train.deterministic)" in log
    again, _, _ = _trained(tmp_path, "b", "--train.deterministic=true")
    assert len(losses) == 3 and losses == again


def test_an_environment_s_cublas_workspace_is_kept_and_another_one_refused(tmp_path, restored):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    _, state, _ = _trained(tmp_path, "a", "--train.deterministic=true", "--train.steps=1")
    assert state[0] and state[3] == ":16:8"
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:2"
    with pytest.raises(ConfigError, match=r"CUBLAS_WORKSPACE_CONFIG :4096:8 or :16:8, but the environment sets "
                                          r"':4096:2'.*unset it"):
        _trained(tmp_path, "b", "--train.deterministic=true", "--train.steps=1")


def test_without_the_flag_the_process_settings_stay(tmp_path, restored):
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.use_deterministic_algorithms(False)
    _, state, log = _trained(tmp_path, "a", "--train.steps=1")
    assert state[0] is False and state[3] is None and "train.deterministic" not in log
