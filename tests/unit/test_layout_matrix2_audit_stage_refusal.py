"""train.stages over a config file that sets train.steps and train.seq_len (layout matrix audit, extras).

`longctx train --config configs/debug.toml --train.stages=48:1,96:2` was refused with "train.steps = 300
contradicts train.stages ...; drop train.steps": the command line held no train.steps to drop (the file sets it),
and after dropping it the next run was refused again for train.seq_len. The refusal now names both keys and the
overrides that agree with the stages, and those overrides load."""

import re

import pytest

from longctx.config import load_config
from longctx.config.rules import parse_stages
from longctx.errors import ConfigError

STAGES = "--train.stages=48:1,96:2"


def test_both_contradictions_and_the_overrides_that_agree_are_named():
    with pytest.raises(ConfigError) as e:
        load_config("configs/debug.toml", [STAGES])
    text = " ".join(str(e.value).split())
    assert "train.steps = 300 contradicts" in text and "train.seq_len = 512 contradicts" in text, text
    given = re.findall(r"--train\.\w+=\d+", text)
    stages = parse_stages(STAGES.split("=", 1)[1])
    assert sorted(given) == sorted([f"--train.steps={sum(s for _, s, _ in stages)}",
                                    f"--train.seq_len={stages[-1][0]}"]), text
    cfg = load_config("configs/debug.toml", [STAGES, *given])  # the overrides it names load
    assert cfg.train.stages == "48:1,96:2"


def test_one_contradiction_names_one_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, [STAGES, "--train.steps=5"])
    text = " ".join(str(e.value).split())
    assert "train.steps = 5 contradicts" in text and "train.seq_len =" not in text and "--train.steps=3" in text


def test_a_stage_batch_that_does_not_split_is_named_as_the_stage_not_train_global_batch():
    """`--train.global_batch=4 --train.stages=48:1:4,96:2:2 --train.grad_accum=2` on 2 data ranks was refused as
    "train.global_batch (2 sequences ...); use a multiple of 4": train.global_batch is 4, the 2 is stage 2's."""
    from longctx.job.checks import check_layout

    cfg = load_config(None, ["--train.stages=48:1:4,96:2:2", "--train.global_batch=4", "--train.grad_accum=2",
                             "--parallel.dp_shard=2"])
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, 2)
    text = " ".join(str(e.value).split())
    assert "stage 2's batch (96:2:2) (2 sequences" in text and "train.global_batch" not in text, text
    check_layout(load_config(None, ["--train.stages=48:1:4,96:2:4", "--train.global_batch=4", "--train.grad_accum=2",
                                    "--parallel.dp_shard=2"]), 2)  # the multiple it names: accepted
