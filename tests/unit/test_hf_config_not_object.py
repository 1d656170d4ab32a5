"""A config.json that is valid JSON but not an object (a list, a number): a clear HFFormatError naming the file,
not the AttributeError traceback of the first `.get` on it."""

import pytest

from longctx.config import load_config
from longctx.config.hf import HFFormatError


@pytest.mark.parametrize("text", ["[1]", "3", '"llama"', "null"])
def test_a_config_json_that_is_not_an_object_is_refused_clearly(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(HFFormatError, match="not an object of the model's keys"):
        load_config(overrides=[f"--model.init_from=hf:{tmp_path}"])
