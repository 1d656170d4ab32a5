"""parallel.zero_pp's names and hpz's node size, checked before launch (job/checks.py check_layout)."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.job.checks import check_layout, hpz_group


def _cfg(*args):
    return load_config("configs/debug.toml", ["--train.global_batch=8", *args])


@pytest.mark.parametrize("args,world,group", [
    (["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=2"], 8, 2),
    (["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=4", "--parallel.dp_replicate=2"], 8, 4),
    (["--parallel.zero_pp= hpz ", "--parallel.ranks_per_node=8"], 8, 8),
    (["--parallel.zero_pp="], 8, None),
])
def test_hpz_group(args, world, group):
    cfg = _cfg(*args)
    assert hpz_group(cfg, check_layout(cfg, world)) == group


def test_hpz_node_size_from_the_launcher(monkeypatch):
    for name, value in {"LOCAL_WORLD_SIZE": "4", "RANK": "0", "WORLD_SIZE": "8"}.items():  # (a launched rank)
        monkeypatch.setenv(name, value)
    cfg = _cfg("--parallel.zero_pp=hpz")
    assert hpz_group(cfg, check_layout(cfg, 8)) == 4


@pytest.mark.parametrize("args,match", [
    (["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=3"], "must split the FSDP group of 8"),
    (["--parallel.zero_pp=hpz", "--parallel.ranks_per_node=8", "--parallel.dp_replicate=2"],
     "must split the FSDP group of 4"),
    (["--parallel.zero_pp=hpz,zpp"], "unknown 'zpp'"),
    (["--parallel.zero_pp=qgz", "--parallel.ranks_per_node=3"], "must split the FSDP group of 8"),
])
def test_bad_zero_pp_is_refused_before_launch(args, match):
    with pytest.raises(ConfigError, match=match):
        check_layout(_cfg(*args), 8)
