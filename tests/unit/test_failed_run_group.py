"""A failed in-process run ends the one-rank process group it made (job/launch.py end_one_rank_group).

memory.model_states = host at world 1 makes a process group of this process alone (FSDP2's CPU
offload needs one). A run that failed after making it left it, so the next job in the same process
(an embedding program that caught the error, the next test module on an xdist worker) failed at its
own group's creation with "trying to initialize the default process group twice"."""

import pytest
import torch.distributed as dist

from longctx.config import load_config
from longctx.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model.layers=1", "--train.seq_len=64", "--train.global_batch=1", "--train.steps=1",
        "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=50",
        "--memory.model_states=host"]


def test_a_host_tier_run_that_fails_after_joining_leaves_no_group(tmp_path):
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("a file where the run directory goes")  # (the run directory is made after the group)
    cfg = load_config("configs/debug.toml", [*TINY, f"--train.run_dir={blocked}"])
    with pytest.raises(FileExistsError):  # (the CLI's preflight says it clearly; train() runs none)
        train(cfg, log=lambda *a, **k: None)
    assert not dist.is_initialized(), "the failed run left its one-rank process group"
    ok = load_config("configs/debug.toml", [*TINY, f"--train.run_dir={tmp_path / 'run'}"])
    result = train(ok, log=lambda *a, **k: None)  # the next job in this process makes its own group
    assert len(result.losses) == 1
    from longctx.job.launch import finish_distributed
    finish_distributed()
    assert not dist.is_initialized()


def test_a_group_the_program_made_after_ending_a_runs_own_is_left_to_it(tmp_path):
    """launch recorded "the group is ours" as a flag that outlived the group: a program that ended a run's group
    itself (dist.destroy_process_group) and made its own had that one ended under it by the next failed run. (A
    finished run now ends its group itself, as train() does; the program's own group after it is still its own.)"""
    quiet = lambda *a, **k: None  # noqa: E731
    train(load_config("configs/debug.toml", [*TINY, f"--train.run_dir={tmp_path / 'a'}"]), log=quiet)
    assert not dist.is_initialized()  # (the run ended its group; the program once had to, destroy_process_group)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # and its own group
    mine = dist.group.WORLD
    try:
        blocked = tmp_path / "not_a_dir"
        blocked.write_text("a file where the run directory goes")
        with pytest.raises(FileExistsError):
            train(load_config("configs/debug.toml", [*TINY, f"--train.run_dir={blocked}"]), log=quiet)
        assert dist.is_initialized() and dist.group.WORLD is mine, "a failed run ended the program's own group"
        from longctx.job.launch import finish_distributed

        finish_distributed()  # (theirs to end: no barrier, no destruction)
        assert dist.is_initialized() and dist.group.WORLD is mine
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
