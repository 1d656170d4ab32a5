"""`longctx plan` with the cyclic garbage collector paused (planner/cli.py paused_gc): a large plan's hundreds of
thousands of footprints make no cycles, and the collector's passes over them were a quarter of its time; it is on
again after the command, and a caller's disabled collector stays disabled."""

import gc

from longctx.planner import search


def test_plan_command_pauses_the_collector_and_restores_it(monkeypatch, tmp_path):
    from longctx.cli import main

    seen = []
    searched = search.plan
    monkeypatch.setattr(search, "plan", lambda *a, **k: seen.append(gc.isenabled()) or searched(*a, **k))
    assert gc.isenabled()
    assert main(["plan", "--model", "debug", "--gpus", "2", "--seq-len", "4096", "--hardware", "h100",
                 "--out", str(tmp_path / "plan.toml")]) in (0, None)
    assert seen == [False]
    assert gc.isenabled()
    gc.disable()
    try:  # a caller's disabled collector stays disabled
        main(["plan", "--model", "debug", "--gpus", "2", "--seq-len", "4096", "--hardware", "h100", "--no-write"])
        assert not gc.isenabled()
    finally:
        gc.enable()
