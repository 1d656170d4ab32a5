"""`longctx eval --model.rope_ms_poe_min=1.5` (or another Ms-PoE setting) without `--model.rope_ms_poe=true` is
one error before work, as generate's (tests/unit/test_generate_audit3_ms_poe_switch.py): before, eval scored with
plain RoPE positions, the figures those of the model without the option asked for, without a word. With the
switch the setting is read."""

import pytest

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.eval.request import prepare
from longctx.models.hf import save_hf
from longctx.models.llama import build_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalmspoe")
    return save_hf(build_model(load_config(overrides=["--model.layers=3", "--model.vocab_size=320"]).model, seed=1),
                   tmp / "hf")


def _prepare(hf, *extra):
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", "passkey", "--lengths", "384",
         "--samples", "1", "--depths", "0.5", *extra])
    return prepare(args, rest, 1)


def test_an_ms_poe_setting_without_the_switch_is_refused(hf):
    with pytest.raises(ConfigError, match=r"--model.rope_ms_poe_min=1.5 sets Ms-PoE, which is off"):
        _prepare(hf, "--model.rope_ms_poe_min=1.5")


def test_with_the_switch_it_is_read(hf):
    m = _prepare(hf, "--model.rope_ms_poe=true", "--model.rope_ms_poe_min=1.5").cfg.model
    assert (m.rope_ms_poe, m.rope_ms_poe_min) == (True, 1.5)
