"""Config keys that were accepted and then read by nothing, and a quoted TOML number or boolean whose error
gave no fix. A key whose option is off is said at setup (config/inert_options.py inert_option_notes), as
train.spike_window without train.spike_factor was already; one that applies is not."""

import pytest

from longctx.config import load_config
from longctx.config.inert_options import inert_option_notes
from longctx.errors import ConfigError


@pytest.mark.parametrize("args, key", [
    # yarn's own keys (models/llama.py reads them under rope_scaling yarn only)
    (["--model.rope_mscale=1"], "model.rope_mscale"),
    (["--model.rope_mscale_all_dim=1"], "model.rope_mscale_all_dim"),
    (["--model.rope_attention_factor=1.2"], "model.rope_attention_factor"),
    (["--model.rope_scaling=llama3", "--model.rope_truncate=false"], "model.rope_truncate"),
    # Ms-PoE's (models/ms_poe.py reads them with model.rope_ms_poe only)
    (["--model.rope_ms_poe_min=1.5"], "model.rope_ms_poe_min"),
    (["--model.rope_ms_poe_order=index"], "model.rope_ms_poe_order"),
    (["--model.rope_ms_poe_skip_layers=1"], "model.rope_ms_poe_skip_layers"),
    # the q/k norm's span with no q/k norm
    (["--model.qk_norm_span=all"], "model.qk_norm_span"),
    # a router's own keys under another router (models/moe.py: DTSRouter, SinkhornRouter)
    (["--model.preset=debug-moe", "--model.moe.dts_steps=50"], "model.moe.dts_steps"),
    (["--model.preset=debug-moe", "--model.moe.dts_eval=top_k"], "model.moe.dts_eval"),
    (["--model.preset=debug-moe", "--model.moe.sinkhorn_iters=3"], "model.moe.sinkhorn_iters"),
    # expert parallelism's own keys without it (parallel/parallelize.py passes them to use_expert_parallel only)
    (["--model.preset=debug-moe", "--parallel.expert_pipeline_chunks=2"], "parallel.expert_pipeline_chunks"),
    (["--model.preset=debug-moe", "--parallel.expert=2", "--parallel.expert_placement_window=5"],
     "parallel.expert_placement_window"),
    # the evaluation's size without evaluation (train/trainer.py evaluates only with train.eval_interval)
    (["--train.eval_interval=0", "--train.eval_batches=8"], "train.eval_batches"),
    # how checkpoints are kept and written, in a run that saves none (train/setup.py makes no manager)
    (["--checkpoint.final=false", "--checkpoint.keep=5"], "checkpoint.keep"),
    (["--checkpoint.final=false", "--checkpoint.async=true"], "checkpoint.async"),
    (["--checkpoint.final=false", "--checkpoint.dir=/tmp/elsewhere"], "checkpoint.dir"),
])
def test_a_key_nothing_reads_is_said(args, key):
    notes = inert_option_notes(load_config(None, args))
    assert any(key in note and "ignored" in note for note in notes), notes


@pytest.mark.parametrize("args", [
    ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=4096",
     "--model.rope_mscale=1", "--model.rope_mscale_all_dim=1", "--model.rope_truncate=false"],
    ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=4096",
     "--model.rope_attention_factor=1.2"],
    ["--model.rope_ms_poe=true", "--model.rope_ms_poe_min=1.5", "--model.rope_ms_poe_order=index"],
    ["--model.preset=olmoe-1b-7b"],  # (qk_norm_span all is its preset's, with its q/k norm)
    ["--model.family=qwen3", "--model.qk_norm=true"],
    ["--model.preset=debug-moe", "--model.moe.router=dts", "--model.moe.dts_steps=50", "--model.moe.dts_eval=top_k"],
    ["--model.preset=debug-moe", "--model.moe.router=sinkhorn", "--model.moe.sinkhorn_iters=3"],
    ["--model.preset=debug-moe", "--parallel.expert=2", "--parallel.expert_pipeline_chunks=2"],
    ["--model.preset=debug-moe", "--parallel.expert=2", "--parallel.expert_replicas=1",
     "--parallel.expert_placement_window=5"],
    ["--train.eval_interval=10", "--train.eval_batches=8"],
    ["--checkpoint.keep=5", "--checkpoint.async=true", "--checkpoint.dir=/tmp/elsewhere"],  # (final true: it saves)
])
def test_a_key_that_applies_is_not_said(args):
    assert inert_option_notes(load_config(None, args)) == []


@pytest.mark.parametrize("line, key, unquoted", [
    ('[train]\ncompile = "true"\n', "train.compile", "compile = true"),
    ('[train]\ncompile = "True"\n', "train.compile", "compile = true"),  # (TOML's booleans are lower case)
    ('[train]\nsteps = "10"\n', "train.steps", "steps = 10"),
    ('[train]\nlr = "1e-4"\n', "train.lr", "lr = 0.0001"),
    ('[model.moe]\nexperts = "4"\n', "model.moe.experts", "moe.experts = 4"),
])
def test_a_quoted_number_or_boolean_in_toml_says_to_drop_the_quotes(tmp_path, line, key, unquoted):
    """A quoted value is a TOML string: 'train.compile must be true or false, got 'true' (str)' named the
    key but read as a contradiction, and gave no fix."""
    path = tmp_path / "c.toml"
    path.write_text(line)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    said = str(e.value)
    assert key in said and "without the quotes" in said and unquoted in said, said


def test_a_string_that_is_no_number_still_says_only_the_type(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "train.lr must be a number" in str(e.value) and "quotes" not in str(e.value)
