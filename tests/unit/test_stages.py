"""train.stages: the config it derives, and the loader that switches length and resumes in the right stage."""

import pytest
import torch

from longctx.config import load_config
from longctx.data.samples import Batch
from longctx.errors import ConfigError
from longctx.train.stages import StagedLoader, stages_of, tokens_through


class _Samples:
    """n samples of `seq_len` tokens; sample i is all i (so a batch names the samples it holds)."""

    def __init__(self, n, seq_len):
        self.n, self.seq_len = n, seq_len

    def __len__(self):
        return self.n

    def batch(self, indices):
        t = torch.tensor(indices)[:, None].expand(-1, self.seq_len)
        return Batch(t, t, t, None)


def _loader(stages="8:3,16:2", read_ahead=False):
    cfg = load_config(None, [f"--train.stages={stages}", "--train.eval_interval=0", "--train.global_batch=2"])
    built = []

    def build(stage_cfg):
        built.append(stage_cfg.train.seq_len)
        return _Samples(10 * stage_cfg.train.seq_len, stage_cfg.train.seq_len), None

    return StagedLoader(cfg, build, dp=1, read_ahead=read_ahead), built


def test_stages_set_steps_and_seq_len():
    cfg = load_config(None, ["--train.stages=1024:200:8,4096:100", "--train.global_batch=2"])
    assert (cfg.train.steps, cfg.train.seq_len) == (300, 4096)
    assert [(s.seq_len, s.first_step, s.last_step, s.global_batch) for s in stages_of(cfg)] == [
        (1024, 1, 200, 8), (4096, 201, 300, 2)]
    assert tokens_through(stages_of(cfg), 201) == 200 * 1024 * 8 + 4096 * 2
    # a config.toml written by a staged run (steps and seq_len spelled out) loads again
    assert load_config(None, ["--train.stages=1024:200,4096:100", "--train.steps=300", "--train.seq_len=4096"])
    with pytest.raises(ConfigError, match="train.seq_len = 2048 contradicts train.stages"):
        load_config(None, ["--train.stages=1024:200,4096:100", "--train.seq_len=2048"])
    with pytest.raises(ConfigError, match="data.path"):
        load_config(None, ["--train.stages=1024:200", "--data.path=/x"])


def test_stage_lengths_must_fit_the_layout():
    from longctx.job.checks import check_layout

    cfg = load_config(None, ["--train.stages=100:2,128:2", "--parallel.ctx=2", "--parallel.head=2"])
    with pytest.raises(ConfigError, match=r"train.stages: stage 1 \(100:2\): sequence length 100 is not divisible"):
        check_layout(cfg, 4)
    cfg = load_config(None, ["--train.stages=128:2:3,128:2", "--parallel.ctx=2", "--parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match="train.stages: stage 1's batch .128:2:3. .3 sequences"):
        check_layout(cfg, 4)


def _run(loader, steps):
    out = []
    for step in steps:
        loader.enter(step)
        b = loader.next_batch()
        out.append((b.tokens.shape[1], b.tokens[:, 0].tolist()))
    return out


def test_loader_switches_length_at_the_boundary_and_resumes_in_any_stage():
    full, built = _loader()
    reference = _run(full, range(1, 6))
    assert [length for length, _ in reference] == [8, 8, 8, 16, 16] and built == [8, 16]
    assert [len(names) for _, names in reference] == [2] * 5
    for saved_at in (1, 2, 3, 4):  # before, at and after the boundary (step 3 is stage 1's last)
        first, _ = _loader()
        _run(first, range(1, saved_at + 1))
        state = first.state_dict()
        resumed, _ = _loader()
        resumed.enter(1)  # what the trainer builds before it knows the checkpoint's step
        resumed.load_state_dict(state)
        assert _run(resumed, range(saved_at + 1, 6)) == reference[saved_at:], saved_at


def test_a_run_without_stages_is_one_stage():
    cfg = load_config(None, ["--train.steps=7", "--train.seq_len=64"])
    assert [(s.seq_len, s.first_step, s.last_step) for s in stages_of(cfg)] == [(64, 1, 7)]
    assert stages_of(cfg)[0].global_batch == cfg.train.global_batch
    loader, _ = _loader("8:5")
    _run(loader, range(1, 3))
    old_format = {k: v for k, v in loader.state_dict().items() if k != "stage"}  # a checkpoint from before stages
    again, _ = _loader("8:5")
    again.enter(1)
    again.load_state_dict(old_format)
    assert again.state_dict() == loader.state_dict()


def test_moved_stage_boundaries_on_resume_are_said_not_silent():
    first, _ = _loader("8:3,16:2")
    _run(first, range(1, 3))  # saved after step 2, in stage 1 of 2
    state = first.state_dict()
    # the same stages: the saved position applies, nothing to say
    same, _ = _loader("8:3,16:2")
    same.enter(1)
    same.load_state_dict(state)
    same.enter(3)
    assert same.position_note is None
    # stage 2 now starts at step 2, so step 3 is its second step: the saved position is stage 1's
    moved, _ = _loader("8:1,16:4")
    moved.enter(1)
    moved.load_state_dict(state)
    got = _run(moved, [3])
    assert "data position is in stage 1, but step 3 is in stage 2" in moved.position_note
    fresh, _ = _loader("8:1,16:4")
    assert got == _run(fresh, [2])  # stage 2's first samples: said, not silently continued
    # stage 2 moved later: step 5 is in stage 1 now, the saved position (stage 2's) is not applied
    second, _ = _loader("8:3,16:2")
    _run(second, range(1, 5))
    later, _ = _loader("8:5,16:1")
    later.enter(1)
    later.load_state_dict(second.state_dict())
    later.enter(5)
    assert "data position is in stage 2, but step 5 is in stage 1" in later.position_note


def _steps(loader, steps):
    """As the trainer reads them: enter the step's stage, take its micro-batches (read ahead, maybe)."""
    out = []
    for step in steps:
        loader.enter(step)
        out.append([(b.tokens.shape[1], b.tokens[:, 0].tolist()) for b, _ in loader.step_batches(step)])
    return out


@pytest.mark.parametrize("read_ahead", [False, True])
@pytest.mark.parametrize("bad, read_at", [
    (3, 4), (3, 5),  # stage 1's last step, read in stage 2: stage 2 starts again at its first sample
    (2, 5),  # a step of stage 1 read in stage 2: the rest of stage 1, then stage 2 from its start
    (4, 5), (2, 3), (3, 3),  # the bad step read in its own stage
])
def test_a_rollback_goes_on_with_the_data_after_the_bad_step_across_a_boundary(bad, read_at, read_ahead):
    """train.on_nonfinite = rollback: steps 1..read_at ran, the position after the bad step is loaded,
    and the steps after it (run again) get the batches a run without the rollback gets."""
    reference = _steps(_loader(read_ahead=read_ahead)[0], range(1, 6))
    loader, _ = _loader(read_ahead=read_ahead)
    positions = {}
    for step in range(1, read_at + 1):
        _steps(loader, [step])
        positions[step] = loader.state_dict()  # what the trainer keeps with each step's loss
    loader.load_state_dict(positions[bad])
    assert loader.state_dict() == positions[bad]  # what a save right after the rollback records
    assert _steps(loader, range(bad + 1, 6)) == reference[bad:]


def test_a_resume_with_other_stages_keeps_what_the_weights_trained_on(tmp_path):
    """A checkpoint trained at 64 tokens, resumed with stages that put the next step in a 32-token stage: the
    new checkpoints recorded trained_positions 32 (rebuilt from this run's stages alone), so generate, export and
    a draft's window cut prompts the weights handle. A stage's explicit batch of 0 is refused (not the default)."""
    import json

    from longctx.config.resume import load_run_config
    from longctx.train.trainer import Trainer

    quiet = lambda *a, **k: None  # noqa: E731
    base = ["--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false",
            "--metrics.progress=false", "--model.layers=2", "--model.dim=32", "--model.heads=2", "--model.kv_heads=2",
            "--train.warmup_steps=1", "--checkpoint.interval=1", "--checkpoint.final=false"]
    Trainer(load_config(None, [*base, "--train.stages=32:1,64:1", f"--train.run_dir={tmp_path}"]), log=quiet).run()
    step = tmp_path / "checkpoints" / "step-00000002"
    assert json.loads((step / "manifest.json").read_text())["trained_positions"] == 64
    # (stage 1 lengthened past the step trained at 64: a plan that moves trained steps is asked for)
    cfg, _ = load_run_config(None, [f"--checkpoint.resume={step}", f"--train.run_dir={tmp_path}",
                                    "--train.stages=32:3,64:1", "--checkpoint.allow_changes=true"], False)
    Trainer(cfg, log=quiet).run()
    after = json.loads((tmp_path / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert after["trained_positions"] == 64
    with pytest.raises(ConfigError, match="'32:2:0' is not SEQ_LEN:STEPS"):
        load_config(None, ["--train.stages=32:2:0,64:2"])


def test_train_global_batch_is_not_checked_when_every_stage_names_its_batch():
    """Each stage's own batch (6) splits over grad_accum 3 and 3 data-parallel ranks; the unused default
    train.global_batch (4) refused the run."""
    from longctx.job.checks import check_layout

    cfg = load_config(None, ["--train.stages=32:2:6,64:2:6", "--train.grad_accum=3"])
    check_layout(cfg, 1)
    check_layout(load_config(None, ["--train.stages=32:2:6,64:2:6", "--parallel.dp_shard=3"]), 3)
    with pytest.raises(ConfigError, match="train.stages: train.global_batch .4 sequences"):
        check_layout(load_config(None, ["--train.stages=32:2:6,64:2", "--parallel.dp_shard=3"]), 3)


def test_a_resume_from_a_manifest_without_trained_positions_records_the_stages(tmp_path):
    """A checkpoint from before the record (2026-11-28): the resume kept run_start_positions' fallback, its
    model.max_seq_len (131,072), as what the weights trained on; the stages' length is what they did."""
    import json

    from longctx.config.resume import load_run_config
    from longctx.train.trainer import Trainer
    from manifest_edits import rewrite_manifest

    quiet = lambda *a, **k: None  # noqa: E731
    base = ["--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0", "--metrics.plots=false",
            "--metrics.progress=false", "--model.layers=2", "--model.dim=32", "--model.heads=2", "--model.kv_heads=2",
            "--train.warmup_steps=1", "--checkpoint.interval=1", "--checkpoint.final=false", "--train.seq_len=32"]
    Trainer(load_config(None, [*base, "--train.steps=2", f"--train.run_dir={tmp_path}"]), log=quiet).run()
    step = tmp_path / "checkpoints" / "step-00000002"
    rewrite_manifest(step, lambda manifest: manifest.pop("trained_positions"))
    cfg, _ = load_run_config(None, [f"--checkpoint.resume={step}", f"--train.run_dir={tmp_path}", "--train.steps=3"],
                             False)
    assert cfg.model.max_seq_len > 32
    Trainer(cfg, log=quiet).run()
    after = json.loads((tmp_path / "checkpoints" / "step-00000003" / "manifest.json").read_text())
    assert after["trained_positions"] == 32
