"""A rollback past a resume that changed the layout runs one layout: the one its checkpoint was written under, on the
ranks that wrote it (config/resume_layout.py, through config/layout.py resolve_layout).

The layout of a resume that names no degree and no --nproc came from the run's config.toml (the later resume's) and
its ranks from the checkpoint's manifest: a run on 4 ranks as head 2 x ctx 2, resumed as `--parallel.ctx 2 --nproc
2`, rolled back to step 1 with no flag ran dp_shard 2 x ctx 2 on 4 ranks; config.toml's ctx 2 on the 1 rank that
wrote step 1 was said and then refused by the preflight. The layouts with more than one rank are written here into
the manifests of a tiny real run (1 rank), as a 4- or 2-rank run writes them; the ranks are read as `longctx train`
reads them (cli.py _saved_world).
"""

import json
import shutil

import pytest

from longctx.checkpoint.manifest import MANIFEST
from longctx.cli import _saved_world
from longctx.config import load_config, to_toml
from longctx.config.layout import resolve_layout
from longctx.train.trainer import Trainer
from manifest_edits import rewrite_manifest

QUIET = lambda *a, **k: None  # noqa: E731
BASE = ["--data.max_docs=40", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--model.dim=32", "--model.heads=4", "--model.kv_heads=4", "--train.eval_interval=0",
        "--train.warmup_steps=1", "--checkpoint.interval=1", "--checkpoint.keep=5", "--train.global_batch=2",
        "--train.seq_len=32"]
FOUR = {"world": 4, "dp_replicate": 1, "dp_shard": 1, "head": 2, "ctx": 2}  # the first run's, as its manifests say
TWO = {"world": 2, "dp_replicate": 1, "dp_shard": 1, "head": 1, "ctx": 2}  # the later resume's
LATER = "the run's config.toml, changed after step 1"
STEP = "checkpoints/step-0000000{}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run's steps 1-2, saved each step (1 rank)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    Trainer(load_config(None, [*BASE, "--train.steps=2", f"--train.run_dir={run}"]), log=QUIET).run()
    return run


def _config(run, *flags) -> str:
    """The run's config.toml with `flags` on top, as a run or resume under them writes it."""
    return to_toml(load_config(run / "config.toml", list(flags)))


def _rewrite(checkpoint, step=None, layout=None, config=None, drop_config=False):
    def edit(manifest):
        manifest["step"] = step or manifest["step"]
        manifest["layout"] = {**manifest["layout"], **(layout or {})}
        if config is not None:
            manifest["config"] = config
        if drop_config:
            manifest.pop("config")

    rewrite_manifest(checkpoint, edit)


@pytest.fixture
def relaid(trained, tmp_path):
    """The issue's run: steps 1-2 on 4 ranks as head 2 x ctx 2; resumed `--parallel.ctx 2 --nproc 2` (head 1 x ctx
    2), which wrote config.toml and step 3 on 2 ranks."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    first = _config(run, "--parallel.head=2", "--parallel.ctx=2")
    later = _config(run, "--parallel.head=1", "--parallel.ctx=2", "--train.steps=3")
    for step in (1, 2):
        _rewrite(run / STEP.format(step), layout=FOUR, config=first)
    shutil.copytree(run / STEP.format(2), run / STEP.format(3))
    _rewrite(run / STEP.format(3), step=3, layout=TWO, config=later)
    (run / "checkpoints" / "latest").write_text("step-00000003")
    (run / "config.toml").write_text(later)
    return run


def _resume(run, spec, *flags, nproc=None):
    return resolve_layout(None, [f"--checkpoint.resume={spec}", f"--train.run_dir={run}", *flags], nproc,
                          saved_world=_saved_world)


def _runs(resolved) -> tuple[int, int, int, int]:
    p = resolved.cfg.parallel
    return p.dp_shard, p.head, p.ctx, resolved.nproc


def _rebuilt_by_the_ranks(resolved):
    """The ranks a launch starts rebuild the same config from the overrides it hands them."""
    rank = resolve_layout(None, resolved.overrides, None, world=resolved.nproc)
    assert to_toml(rank.cfg) == to_toml(resolved.cfg)


def test_a_rollback_runs_the_layout_its_checkpoint_was_written_under_on_its_ranks(relaid):
    resolved = _resume(relaid, relaid / STEP.format(1))
    assert _runs(resolved) == (-1, 2, 2, 4)  # head 2 x ctx 2 on the 4 ranks that wrote step 1 (not dp_shard 2 x ctx 2)
    said = resolved.resumed.describe()
    assert (f"parallel.head 1 ({LATER}) not applied: step 1 runs the layout it was written under, head 2 x ctx 2 on "
            f"4 ranks (written back to config.toml); name a degree or --nproc to run another") in said, said
    assert f"train.steps 2 -> 3 ({LATER})" in said  # (the rest of config.toml still runs, said as before)
    assert "parallel.head 2 -> 1" not in said and "parallel.head 1 -> 2" not in said  # (one statement of the layout)
    _rebuilt_by_the_ranks(resolved)


def test_naming_a_degree_or_nproc_runs_the_command_lines_layout_as_before(relaid):
    step_1 = relaid / STEP.format(1)
    assert _runs(_resume(relaid, step_1, nproc=2)) == (-1, 1, 2, 2)  # (2 ranks' default layout)
    named = _resume(relaid, step_1, "--parallel.ctx=4")
    assert _runs(named) == (-1, 1, 4, 4)  # (the degree named, the rest the default of the checkpoint's 4 ranks)
    assert "not applied" not in named.resumed.describe()
    assert _runs(_resume(relaid, step_1, "--parallel.placement=ctx-first")) == (-1, 2, 2, 4)  # (4 ranks: default)


def test_a_resume_of_the_newest_checkpoint_is_unchanged(relaid):
    for spec in ("auto", relaid / STEP.format(3)):
        resolved = _resume(relaid, spec)
        assert _runs(resolved) == (-1, 1, 2, 2)
        assert resolved.resumed.describe().endswith("nothing changed")


def test_config_toml_at_ctx_2_and_a_checkpoint_of_1_rank_runs_1_rank(trained, tmp_path):
    """The issue's second case: config.toml at ctx 2 (a later resume on 2 ranks), step 1 written by 1 rank: said as
    ctx 2 and then refused by the preflight ("world size 1 is not divisible ... --nproc 2")."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "config.toml").write_text(_config(run, "--parallel.ctx=2"))
    resolved = _resume(run, run / STEP.format(1))
    assert _runs(resolved) == (-1, 1, 1, 1)
    said = resolved.resumed.describe()
    assert (f"parallel.ctx 2 ({LATER}) not applied: step 1 runs the layout it was written under, 1 rank, no parallel "
            f"degree (written back to config.toml)") in said, said
    assert "parallel.ctx 2 -> 1" not in said and "parallel.ctx 1 -> 2" not in said
    _rebuilt_by_the_ranks(resolved)


def test_a_checkpoint_without_a_recorded_config_keeps_its_manifests_layout(relaid):
    _rewrite(relaid / STEP.format(1), drop_config=True)
    resolved = _resume(relaid, relaid / STEP.format(1))
    assert _runs(resolved) == (-1, 2, 2, 4)  # (the manifest's degrees, dp_shard 1 there, spelled as config.toml)
    said = resolved.resumed.describe()
    assert "not applied: step 1 runs the layout it was written under, head 2 x ctx 2 on 4 ranks" in said, said
    assert "parallel.dp_shard" not in said  # (its 1 is what config.toml's -1 infers under head 2 x ctx 2)
    _rebuilt_by_the_ranks(resolved)


def test_a_manifest_without_degrees_resumes_as_before(relaid):
    """A checkpoint that records neither its config nor its degrees (only the world): config.toml's layout on the
    ranks that wrote it, as before."""
    path = relaid / STEP.format(1) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.pop("config")
    manifest["layout"] = {"world": 4}
    path.write_text(json.dumps(manifest))
    resolved = _resume(relaid, relaid / STEP.format(1))
    assert _runs(resolved) == (-1, 1, 2, 4)
    assert "not applied" not in resolved.resumed.describe()


def test_a_placement_changed_later_is_the_checkpoints_too(relaid):
    """The whole layout is the checkpoint's, placement, window and expert with the degrees."""
    (relaid / "config.toml").write_text(_config(relaid, "--parallel.placement=ctx-first"))
    resolved = _resume(relaid, relaid / STEP.format(1))
    assert (resolved.cfg.parallel.placement, *_runs(resolved)) == ("head-first", -1, 2, 2, 4)
    assert "parallel.head 1, parallel.placement 'ctx-first' (" in resolved.resumed.describe()
