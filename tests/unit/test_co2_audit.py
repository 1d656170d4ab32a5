"""train.data_parallel = co2's audit (config/data_parallel.py): a run that co2 cannot train is refused
before launch with one clear error, not met by a crash after the model (and a target) is built."""

import dataclasses

import pytest

from longctx.config import load_config
from longctx.config.data_parallel import data_parallel_problems

CO2 = ["--train.data_parallel=co2", "--parallel.dp_replicate=2"]


def _with_draft(cfg, kind: str):
    # (load_config reads the target's own config from draft.target: a checkpoint this unit test does not build)
    return dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, target="/ckpt/target", kind=kind))


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_a_draft_under_co2_is_refused_before_launch(kind):
    # parallelize_draft shards a GliDe / Clover draft over the (dp_replicate, fsdp) mesh, as under sync, and
    # sets no replica group: co2's set-up raised "AttributeError: 'FSDPGlideTraining' object has no
    # attribute 'co2_replicas'" on every rank, after the target had been loaded
    problems = data_parallel_problems(_with_draft(load_config(None, CO2), kind))
    assert len(problems) == 1
    assert "draft.target" in problems[0] and "use train.data_parallel = sync" in problems[0]


def test_a_draft_under_sync_and_co2_without_a_draft_are_accepted():
    assert data_parallel_problems(load_config(None, CO2)) == []
    assert data_parallel_problems(_with_draft(load_config(None, ["--parallel.dp_replicate=2"]), "glide")) == []
