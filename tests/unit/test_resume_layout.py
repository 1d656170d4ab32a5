"""The layout rule of `longctx train`, in one function (config/layout.py resolve_layout): a resume
keeps the saved layout unless the command line names a degree or --nproc, and then the layout is
wholly the command line's, completed by the default layout. What a resume prints is what runs: each
printed change is a real difference between the saved config.toml and the config the ranks build
(issue 53: `--parallel.expert 1` once printed `parallel.ctx 2 -> 1` and ran ctx 2)."""

import pytest

from longctx.config import load_config, to_dict, to_toml
from longctx.config.layout import resolve_layout


def _saved_run(tmp_path, overrides):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, overrides)))
    return run


def _resume(run, extra, nproc=None, saved_world=None):
    return resolve_layout(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", *extra], nproc,
                          saved_world=lambda cfg: saved_world)


def _printed(resolved) -> dict[str, tuple[str, str]]:
    out = {}
    for change in resolved.resumed.changes:
        key, rest = change.split(" ", 1)
        before, after = rest.split(" -> ")
        out[key] = (before, after)
    return out


def _actual(run, cfg) -> dict[str, tuple[str, str]]:
    saved, now = to_dict(load_config(run / "config.toml")), to_dict(cfg)
    return {f"parallel.{k}": (str(saved["parallel"][k]), str(now["parallel"][k]))
            for k in now["parallel"] if saved["parallel"][k] != now["parallel"][k]}


# (the saved run's layout, the resume's command line, its --nproc, ranks that wrote the checkpoint,
#  the layout the resume must run)
CASES = [
    # issue 53's example: expert 2 x ctx 2 on 2 ranks, resumed with only --parallel.expert 1: the
    # command line's layout (expert 1) completed by the 2-rank default (ctx 2), on the saved 2 ranks
    (["--model.preset=debug-moe", "--parallel.expert=2", "--parallel.ctx=2"], ["--parallel.expert=1"], None, 2,
     {"ctx": 2, "head": 1, "expert": 1}),
    # a degree named: the whole layout is the command line's (the saved head 2 does not stay)
    (["--parallel.head=2", "--parallel.ctx=2"], ["--parallel.ctx=4"], None, 4, {"ctx": 4, "head": 1}),
    # --nproc alone: the default layout of that many ranks
    (["--parallel.head=2", "--parallel.ctx=2"], [], 2, 4, {"ctx": 2, "head": 1}),
    # nothing named: the saved layout, on as many ranks as wrote the checkpoint
    (["--parallel.head=2", "--parallel.ctx=2"], ["--train.steps=30"], None, 4, {"ctx": 2, "head": 2}),
]


@pytest.mark.parametrize("saved, given, nproc, world, expected", CASES)
def test_resume_runs_the_layout_it_prints(tmp_path, saved, given, nproc, world, expected):
    run = _saved_run(tmp_path, saved)
    resolved = _resume(run, given, nproc, world)
    p = resolved.cfg.parallel
    assert {k: getattr(p, k) for k in expected} == expected
    assert resolved.nproc == (nproc or world)
    printed = {k: v for k, v in _printed(resolved).items() if k.startswith("parallel.")}
    assert printed == _actual(run, resolved.cfg)  # every printed layout change happens, and only those
    # the ranks the launch starts rebuild the same config from the overrides it hands them
    rank = resolve_layout(None, resolved.overrides, None, world=resolved.nproc)
    assert to_toml(rank.cfg) == to_toml(resolved.cfg)


def test_issue_example_prints_only_the_expert_change(tmp_path):
    run = _saved_run(tmp_path, ["--model.preset=debug-moe", "--parallel.expert=2", "--parallel.ctx=2"])
    resolved = _resume(run, ["--parallel.expert=1"], None, 2)
    assert [c for c in resolved.resumed.changes if c.startswith("parallel.")] == ["parallel.expert 2 -> 1"]


def test_new_run_default_layout_bends_to_heads():
    resolved = resolve_layout(None, ["--model.heads=9", "--model.kv_heads=3", "--model.dim=144"], 4)
    assert (resolved.cfg.parallel.head, resolved.cfg.parallel.ctx) == (1, 4)
    assert "ctx 4" in resolved.note
    plain = resolve_layout(None, [], 4)
    assert (plain.cfg.parallel.head, plain.cfg.parallel.ctx, plain.note) == (2, 2, None)
