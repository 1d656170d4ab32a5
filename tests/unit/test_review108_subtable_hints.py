"""A hint that says how to write a sub-table's key in a config file: docs/moe.md writes the keys in a [model.moe]
table (`experts = 8`), where the hint's `moe.experts = 8` names model.moe.moe.experts, an unknown key. The hint
says both spellings, each where it goes; a plain key's hint stays `steps = 1000`."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError

MOE = '[model]\npreset = "debug-moe"\n[model.moe]\n'


@pytest.mark.parametrize("body, fix", [
    ("experts = 8.0\n", "moe.experts = 8 under [model] (or experts = 8 in a [model.moe] table)"),
    ('experts = "8"\n', "moe.experts = 8 under [model] (or experts = 8 in a [model.moe] table)"),
    ("dense_layers = [0, 1]\n", 'moe.dense_layers = "0,1" under [model] (or dense_layers = "0,1" in a [model.moe]'),
    ('dense_layers = "null"\n', 'moe.dense_layers = "" under [model] (or dense_layers = "" in a [model.moe] table)'),
])
def test_a_sub_tables_key_is_hinted_as_written_in_its_table(body, fix, tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(MOE + body)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert fix in str(e.value)
    # the hint's second spelling, as given, is the key: accepted in its table
    p.write_text(MOE + fix.split("(or ")[1].split(" in a [")[0] + "\n")
    load_config(p)


def test_a_plain_keys_hint_is_unchanged(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[train]\nsteps = 1e3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "1000.0 is 1000: write steps = 1000." in str(e.value)
