"""Options `longctx train` accepted and silently ignored (the run trained as without them, its config.toml
and setup line naming them as if they applied), now refused before any work with the setting that makes
them apply (config/inert_options.py), or a setup note where a legitimate path writes them:

- any [draft] key without draft.target (the run trains the model itself: same losses as without it);
- parallel.zero_pp on one process (FSDP is not applied), parallel.hpz_ranks without hpz, parallel.zero_pp
  beside a draft (its FSDP is plain), model.rope_factor under model.rope_scaling none;
- parallel.expert_replicas beyond the E - E / expert experts a rank can hold a copy of;
- train.co2_* under train.data_parallel sync, and parallel.zero_pp_block without qwz / qgz: a note each,
  since `longctx plan` takes them in its sync, unquantized base config to cost its co2 / quantized plans.
parallel.grad_bucket_blocks above the model's layers is clamped (one unit of every block), by the run
and the planner's costs alike, and the setup line states the real buckets: left as it is."""

import types

import pytest
import torch

from longctx.config import load_config, to_toml
from longctx.errors import ConfigError


def _refused(overrides, *phrases):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for phrase in phrases:
        assert phrase in str(e.value), str(e.value)


@pytest.mark.parametrize("given", [["--draft.kind=clover"], ["--draft.loss=kd", "--draft.block=8"],
                                   ["--draft.layers=2"], ["--draft.vocab=100"]])
def test_draft_keys_without_a_target_are_refused(given):
    _refused(given, "would be ignored", "draft.target is ''", "--draft.target DIR")


def test_a_saved_config_of_a_normal_run_still_loads(tmp_path):
    """Every config.toml lists [draft] (and the rest) at its defaults: not 'given'."""
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(load_config(None, ["--train.seq_len=64"])))
    assert load_config(saved, []).draft.target == ""
    big = tmp_path / "big.toml"  # a preset's own rope_factor under rope_scaling none is the preset's, not given
    big.write_text(to_toml(load_config(None, ["--model.preset=llama3-1b", "--model.rope_scaling=none"])))
    assert load_config(big, []).model.rope_factor == 32.0


def test_zero_pp_on_one_process_is_refused_before_launch():
    from longctx.job.checks import check_layout

    cfg = load_config(None, ["--parallel.zero_pp=hpz,qwz"])
    with pytest.raises(ConfigError, match=r"parallel.zero_pp = 'hpz,qwz' would be ignored.*one process"):
        check_layout(cfg, 1)
    check_layout(cfg, 2)  # (FSDP over two ranks: it applies)
    check_layout(load_config(None, ["--parallel.zero_pp=qwz", "--memory.model_states=host"]), 1)  # (FSDP at 1)


def test_hpz_ranks_without_hpz_is_refused():
    _refused(["--parallel.zero_pp=qwz", "--parallel.hpz_ranks=2"], "parallel.hpz_ranks = 2 would be ignored",
             "add hpz to parallel.zero_pp")
    load_config(None, ["--parallel.zero_pp=hpz", "--parallel.hpz_ranks=2"])


def test_rope_factor_without_scaling_is_refused():
    _refused(["--model.rope_factor=4"], "model.rope_factor = 4.0 would be ignored", "--model.rope_scaling")
    assert load_config(None, ["--model.rope_factor=4", "--model.rope_scaling=linear"]).model.rope_factor == 4.0


def test_expert_replicas_past_what_a_rank_can_hold_are_refused():
    moe = ["--model.preset=debug-moe", "--parallel.expert=2"]
    experts = load_config(None, moe).model.moe_experts
    usable = experts - experts // 2  # a rank owns E / 2 and can copy each of the other E / 2 once
    _refused([*moe, f"--parallel.expert_replicas={usable + 1}"], f"at most {usable}")
    assert load_config(None, [*moe, f"--parallel.expert_replicas={usable}"]).parallel.expert_replicas == usable


def _setup_lines(cfg):
    from longctx.train.run_lines import describe_run

    dims = types.SimpleNamespace(expert=1)
    return describe_run(cfg, 1, dims, torch.nn.Linear(2, 2), torch.device("cpu"), torch.float32, "peak")


def test_co2_keys_under_sync_are_a_setup_note():
    lines = _setup_lines(load_config(None, ["--train.co2_local_steps=8", "--train.co2_outer_momentum=0.9"]))
    note = [line for line in lines if "co2_local_steps" in line]
    assert note and "train.co2_outer_momentum = 0.9 are ignored" in note[0] and note[0].startswith("note: ")
    assert not [line for line in _setup_lines(load_config(None, [])) if "co2" in line]


def test_zero_pp_block_without_quantization_is_a_setup_note():
    lines = _setup_lines(load_config(None, ["--parallel.zero_pp=hpz", "--parallel.zero_pp_block=256"]))
    assert any("parallel.zero_pp_block = 256 is ignored" in line for line in lines), lines
    quantized = load_config(None, ["--parallel.zero_pp=qgz", "--parallel.zero_pp_block=256"])
    assert not [line for line in _setup_lines(quantized) if "zero_pp_block" in line]


def test_zero_pp_beside_a_draft_is_refused():
    """A draft's FSDP is plain (parallel/parallelize.py parallelize_draft): no hpz, qwz or qgz at any world."""
    import dataclasses

    from longctx.config.inert_options import inert_option_problems

    cfg = load_config(None, ["--parallel.zero_pp=qwz"])
    drafting = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, target="runs/target/checkpoints"))
    assert any("parallel.zero_pp = 'qwz' would be ignored" in p for p in inert_option_problems(drafting))
    assert not inert_option_problems(cfg)
