"""A resume asked to change the model's weight shapes (config/resume.py _refuse_other_weights): it was refused
with "add --checkpoint.allow_changes true ... or start a new run from its weights with --model.init_from",
and each of those was refused in turn by the load ("written for another model", "contradicts the weights").
No flag makes it loadable: said at once, with the two ways that work. Changes that keep the shapes (RoPE)
keep the allow_changes advice."""

import pytest
from test_config_sections_audit import _saved_run

from longctx.config.resume import load_run_config
from longctx.errors import ConfigError


@pytest.mark.parametrize("change, said", [("--model.layers=1", "model.layers 2 -> 1"),
                                          ("--model.kv_heads=1", "model.kv_heads 2 -> 1"),
                                          ("--model.ffn_dim=96", "-> 96")])
def test_a_change_of_weight_shapes_is_said_as_no_flag_can_make_it_load(tmp_path, change, said):
    run = _saved_run(tmp_path, "--model.preset=debug", "--model.layers=2", "--model.kv_heads=2")
    resume = [f"--train.run_dir={run}", "--checkpoint.resume=auto"]
    for extra in ([], ["--checkpoint.allow_changes=true"]):
        with pytest.raises(ConfigError, match="shapes of the model's weights") as e:
            load_run_config(None, [*resume, change, *extra], False)
        assert said in str(e.value) and "allow_changes" not in str(e.value) and "init_from" in str(e.value)


def test_a_change_that_keeps_the_shapes_keeps_its_advice(tmp_path):
    run = _saved_run(tmp_path, "--model.preset=debug")
    with pytest.raises(ConfigError, match="would change the model: model.rope_theta .*allow_changes true"):
        load_run_config(None, [f"--train.run_dir={run}", "--checkpoint.resume=auto", "--model.rope_theta=20000"],
                        False)
