"""tests/conftest.py ends a default process group an earlier module left (an in-process run that failed before
finish_distributed). It ended the group only: launch still recorded the group as its own (_CREATED), so the next
in-process command's finish_distributed ended the group a later module's fixture had made (a group "someone else
created is theirs to end"), and that module failed only after the leaking one: the order-dependence the guard
is there to remove."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

_LEAVES = '''
from longctx.job import launch


def test_an_in_process_run_that_failed_before_finish_distributed():
    launch.init_one_rank_group("cpu")  # (what a failed in-process run leaves: its group, recorded as launch's)
'''

_OWN_GROUP = '''
import pytest
import torch.distributed as dist

from longctx.job import launch


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_in_process_command_inside_the_modules_own_group(one_rank_world):
    launch.init_one_rank_group("cpu")  # (joins the group there is, as a command run in-process does)
    launch.finish_distributed()
    assert dist.is_initialized()
'''


def test_a_group_left_by_one_module_does_not_end_the_next_modules_own(tmp_path):
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_a_leaves.py").write_text(_LEAVES)
    (tmp_path / "test_b_own_group.py").write_text(_OWN_GROUP)
    src = str(Path(__file__).parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-c", os.devnull,
                          "--rootdir", str(tmp_path), "test_a_leaves.py", "test_b_own_group.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout and "left by test_a_leaves" in run.stdout
