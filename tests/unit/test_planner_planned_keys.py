"""`longctx plan` writes the layout, memory policy, batch, length and data-parallel mode it chose over
the base config: an override of one of those (`--train.data_parallel=co2` with a sync plan, a
`--memory.recompute` the plan replaced) came out of the written config overwritten without a word.
Refused before planning, naming the plan's own flag; other overrides still travel into the plan."""

import argparse

import pytest

from longctx.errors import ConfigError
from longctx.planner.cli import PLANNED_KEYS, add_arguments, build_request, main
from longctx.planner.output import plan_config


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


ARGS = ["--model", "debug", "--gpus", "8", "--seq-len", "64K", "--hardware", "h100"]


@pytest.mark.parametrize("override, flag", [
    ("--train.data_parallel=co2 --parallel.dp_replicate=2", "--allow co2"), ("--train.seq_len=4096", "--seq-len"),
    ("--memory.recompute=full", "--recompute"), ("--parallel.ctx=4", "--gpus"),
    ("--memory.model_states=host", "--model-states"), ("--train.global_batch=16", "--global-batch")])
def test_an_override_the_plan_would_overwrite_is_refused(override, flag):
    with pytest.raises(ConfigError, match=f"the plan chooses .*{override.split('=')[0][2:]} \\(its flag: {flag}"):
        build_request(_args(ARGS), override.split())


def test_other_overrides_travel_into_the_written_plan(tmp_path):
    req, base = build_request(_args(ARGS), ["--train.lr=0.001", "--checkpoint.interval=50"])
    assert base.train.lr == 0.001
    out = tmp_path / "plan.toml"
    assert main(_args([*ARGS, "--out", str(out)]), ["--train.lr=0.001"]) == 0
    from longctx.config import load_config

    written = load_config(str(out), [])
    assert written.train.lr == 0.001 and written.train.data_parallel == "sync"


def test_what_the_plan_overwrites_is_in_the_list():
    """Every setting the written plan changes from the base config is one the list refuses an override
    of (a key plan_config starts writing must join it), and every listed key exists."""
    from longctx.config import to_dict
    from longctx.planner.search import plan

    for extra in ([], ["--allow", "co2", "--gpus-per-node", "4", "--hw", "inter_gbps=1"]):
        req, base = build_request(_args([*ARGS, *extra]), [])
        res = plan(req)
        for best in [*res.feasible[:3], *res.co2_plans[:1]]:
            written, given = to_dict(plan_config(best, req, base)), to_dict(base)
            changed = {f"{s}.{k}" for s in ("parallel", "memory", "train") for k in written[s]
                       if written[s][k] != given[s][k]}
            assert changed <= set(PLANNED_KEYS), changed - set(PLANNED_KEYS)
    assert all(key.split(".")[1] in to_dict(base)[key.split(".")[0]] for key in PLANNED_KEYS)
