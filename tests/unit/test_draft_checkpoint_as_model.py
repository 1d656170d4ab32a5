"""A draft's checkpoint named where a model is expected (generate --checkpoint, eval, model.init_from) is
refused by its path, with the command that uses it beside its target: the message named model.init_from, a
setting the user of generate never gave."""

import json

import pytest

from longctx.config import load_config


def test_a_drafts_checkpoint_is_refused_as_a_model_with_the_command_that_reads_it(tmp_path):
    step = tmp_path / "step-00000003"
    step.mkdir()
    (step / "manifest.json").write_text(json.dumps({"draft": {"target": {"path": "runs/a/checkpoints"}},
                                                    "model": {}}))
    with pytest.raises(Exception, match=r"is a GliDe draft's checkpoint .*longctx generate --checkpoint "
                                        r"runs/a/checkpoints --draft ") as err:
        load_config(None, [f"--model.init_from={step}"])
    assert not str(err.value).startswith("model.init_from")
