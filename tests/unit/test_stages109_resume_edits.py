"""A 64 -> 128 token staged run resumed with train.stages edited (audit stages109).

- A longer stage added at the end while the run is inside its last stage (the usual 4K -> 32K, then 128K too):
  the eval-split grid of the run's stores followed the new longest stage, so the store of the stage the run was
  in was rebuilt with other samples and the resume was refused as "rebuilt with other content" (with
  --checkpoint.allow_changes: the saved cursor into those other samples, and eval text the run had trained on).
  A resume now keeps its checkpoint's grid, says so, and goes on exactly.
- Edits that move the steps already trained into other stages (a stage inserted before the current one, its
  length changed, its steps cut below the step reached, a finished stage changed) started the next stage's data
  at its store's first samples (silently when the step fell on a stage's first) or failed with that store
  message: refused at once now, naming the stage and the train.stages that continues.
"""

import json
import shutil

import pytest

from longctx.config import load_config
from longctx.config.resume import load_run_config
from longctx.errors import ConfigError
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

BASE = ["--data.max_docs=40", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--model.dim=32", "--model.heads=2", "--model.kv_heads=2", "--metrics.log_interval=1",
        "--train.eval_interval=0", "--train.warmup_steps=1", "--train.global_batch=2", "--checkpoint.interval=1",
        "--checkpoint.keep=10", "--train.stages=64:3,128:3"]


def _quiet(*_args, **_kwargs):
    pass


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run, a checkpoint at every step: its losses."""
    run = tmp_path_factory.mktemp("full")
    result = Trainer(load_config(None, [*BASE, f"--train.run_dir={run}"]), log=_quiet).run()
    return run, result.losses


def _copy_at(full_run, tmp_path, step: int):
    """The full run as it was when its checkpoint of `step` was the newest."""
    run = tmp_path / "run"
    shutil.copytree(full_run[0], run)
    for later in range(step + 1, 7):
        shutil.rmtree(run / "checkpoints" / f"step-{later:08d}")
    (run / "checkpoints" / "latest").write_text(f"step-{step:08d}\n")
    return run


def _resume(run, *overrides):
    return load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", *overrides], False)[0]


@pytest.mark.parametrize("crash_at", [4, 5])  # (resumed at stage 1's last step, and at stage 2's first)
def test_a_resume_at_the_boundary_gives_the_same_losses_bitwise(full_run, tmp_path, crash_at):
    run = tmp_path / "run"
    trainer = Trainer(load_config(None, [*BASE, f"--train.run_dir={run}"]), log=_quiet)
    run_until_crash(trainer, crash_at)
    resumed = Trainer(_resume(run), log=_quiet).run()
    assert resumed.first_step == crash_at
    assert resumed.losses == full_run[1][crash_at - 1:]


def test_a_longer_stage_added_inside_the_last_one_goes_on_exactly(full_run, tmp_path):
    run = _copy_at(full_run, tmp_path, 5)
    said = []
    result = Trainer(_resume(run, "--train.stages=64:3,128:3,256:2"), log=said.append).run()
    assert result.first_step == 6
    assert result.losses[0] == full_run[1][5]  # step 6: stage 2's next samples, on the same weights
    assert any("grid of 128 tokens" in line for line in said), said
    manifest = json.loads((run / "checkpoints" / "step-00000008" / "manifest.json").read_text())
    assert (manifest["holdout_tokens"], manifest["trained_positions"]) == (128, 256)


@pytest.mark.parametrize("stages, said", [
    ("64:3,128:1", "stage 2 ('128:3', steps 4-6 at 128 tokens, trained through step 5) is now '128:1'"),
    ("64:3,128:1,256:2", "stage 2 ('128:3', steps 4-6 at 128 tokens, trained through step 5) is now '128:1'"),
    ("64:3,96:1,128:3", "stage 2 ('128:3', steps 4-6 at 128 tokens, trained through step 5) is now '96:1'"),
    ("64:3,256:3", "stage 2 ('128:3', steps 4-6 at 128 tokens, trained through step 5) is now '256:3'"),
    ("32:3,128:3", "stage 1 ('64:3', steps 1-3 at 64 tokens, finished) is now '32:3'"),
])
def test_edits_that_move_the_trained_steps_are_refused_naming_the_stage(full_run, tmp_path, stages, said):
    run = _copy_at(full_run, tmp_path, 5)
    with pytest.raises(ConfigError) as e:
        _resume(run, f"--train.stages={stages}")
    text = " ".join(str(e.value).split())
    assert said in text and "train.stages beginning '64:3,128:2'" in text, text
    assert "--checkpoint.allow_changes true" in text
    _resume(run, f"--train.stages={stages}", "--checkpoint.allow_changes=true")  # (asked for: accepted)


@pytest.mark.parametrize("stages", ["64:3,128:2,256:1", "64:3,128:5", "64:3,128:3:4", "64:3,128:3,64:2"])
def test_edits_after_the_step_reached_are_accepted(full_run, tmp_path, stages):
    """The current stage cut at the step reached (the next one starts at its first sample), lengthened, another
    batch, stages added at the end: the checkpoint's data position applies where it did."""
    assert _resume(_copy_at(full_run, tmp_path, 5), f"--train.stages={stages}").train.stages == stages
