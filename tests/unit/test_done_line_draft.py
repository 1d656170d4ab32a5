"""A draft run's closing line names the command that reads its checkpoint: the draft beside its target
(`longctx generate --checkpoint TARGET --draft DIR`), not `--checkpoint DIR`, which refuses a draft."""

from types import SimpleNamespace

from longctx.train.run_lines import done_line


def _line(tmp_path, draft_target=""):
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step-00000003").mkdir(parents=True)
    result = SimpleNamespace(losses=[5.7, 5.6], first_step=1, eval_losses={}, ended_at=None)  # (TrainResult's fields)
    return done_line(result, 3, 1.0, tmp_path, True, ckpts, draft_target)


def test_a_draft_runs_done_line_names_its_target(tmp_path):
    line = _line(tmp_path, "runs/a/checkpoints")
    assert f"`longctx generate --checkpoint runs/a/checkpoints --draft {tmp_path / 'checkpoints'}`" in line


def test_a_plain_runs_done_line_is_unchanged(tmp_path):
    assert f"`longctx generate --checkpoint {tmp_path / 'checkpoints'}` reads them" in _line(tmp_path)
