"""Keys that only tune another option, given while that option is off, are said at setup (config/inert_options.py
inert_option_notes), not silently ignored: the spike check's window without its factor, offload_skip_last
without an offload, a RoPE scaling's own keys under another scaling."""

import pytest

from longctx.config import load_config
from longctx.config.inert_options import inert_option_notes


@pytest.mark.parametrize("args, said", [
    (["--train.spike_window=8"], "train.spike_window = 8 is ignored"),
    (["--memory.offload_skip_last=2"], "memory.offload_skip_last = 2 is ignored"),
    (["--model.rope_beta_fast=16"], "model.rope_beta_fast = 16.0 is ignored: model.rope_scaling is 'none'"),
    (["--model.rope_scaling=linear", "--model.rope_factor=4", "--model.rope_original_max_len=4096"],
     "model.rope_original_max_len = 4096 is ignored"),
    (["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_low_freq_factor=2"],
     "model.rope_low_freq_factor = 2.0 is ignored"),
])
def test_a_key_whose_option_is_off_is_said(args, said):
    assert any(said in note for note in inert_option_notes(load_config(None, args)))


@pytest.mark.parametrize("args", [
    [], ["--train.spike_window=8", "--train.spike_factor=5"],
    ["--memory.recompute=full", "--memory.offload_fraction=0.5", "--memory.offload_skip_last=0"],
    ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_beta_fast=16",
     "--model.rope_original_max_len=4096"],
    ["--model.preset=llama3-1b"],  # (its llama3 keys are the preset's)
])
def test_keys_that_apply_are_not_said(args):
    assert inert_option_notes(load_config(None, args)) == []
