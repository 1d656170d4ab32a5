"""RoPE settings refused at config validation: llama3 scaling's frequency factors (checked for every
family, not only where a bias flag was wrong) and Ms-PoE's ratio range, before any model is built."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError


@pytest.mark.parametrize("args,says", [
    (["--model.rope_scaling=llama3", "--model.rope_low_freq_factor=5"], "llama3 rope scaling needs"),
    (["--model.rope_ms_poe=true", "--model.rope_ms_poe_min=2", "--model.rope_ms_poe_max=1.5"], "rope_ms_poe"),
])
def test_bad_rope_settings_are_refused_at_validation(args, says):
    with pytest.raises(ConfigError, match=says):
        load_config("configs/debug.toml", args)


def test_sound_settings_pass():
    load_config("configs/debug.toml", ["--model.rope_scaling=llama3", "--model.rope_low_freq_factor=1"])
    load_config("configs/debug.toml", ["--model.preset=llama3-8b"])
