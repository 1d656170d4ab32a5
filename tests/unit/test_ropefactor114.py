"""model.rope_factor below 1 under a RoPE scaling: the factor is the extended context over the original, so a
factor in (0, 1) shortens what the scaling is there to lengthen (linear divides positions by it, stretching them
past the trained ones; llama3's and yarn's bands assume >= 1). transformers only logs a warning; a run here is
refused at load, naming the key and the fix. 1 (no change) and above are accepted."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError

ORIGINAL = ["--model.rope_original_max_len=64"]


@pytest.mark.parametrize("scaling", ["linear", "llama3", "yarn"])
@pytest.mark.parametrize("factor", [0.5, 0.999])
def test_a_factor_below_one_is_refused_naming_the_key(scaling, factor):
    with pytest.raises(ConfigError, match=r"model\.rope_factor = .* is below 1.*at least 1"):
        load_config(None, [f"--model.rope_scaling={scaling}", f"--model.rope_factor={factor}", *ORIGINAL])


@pytest.mark.parametrize("scaling", ["linear", "llama3", "yarn"])
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_a_factor_of_one_or_more_loads(scaling, factor):
    cfg = load_config(None, [f"--model.rope_scaling={scaling}", f"--model.rope_factor={factor}", *ORIGINAL])
    assert cfg.model.rope_factor == factor
