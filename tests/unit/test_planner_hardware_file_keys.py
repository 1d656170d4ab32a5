"""A --hardware TOML file is read from its [hardware] table; a field written above that table (or in
another table) used to be dropped without a word, so the plan was made for the base preset's value."""

import pytest

from longctx.costs.hardware import load_hardware
from longctx.errors import ConfigError


def test_field_outside_the_hardware_table_is_refused(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text('memory_gib = 40\n\n[hardware]\nbase = "h100"\n')
    with pytest.raises(ConfigError, match="memory_gib outside its \\[hardware\\] table"):
        load_hardware(str(f))


def test_fields_in_the_table_or_alone_are_read(tmp_path):
    table, bare = tmp_path / "table.toml", tmp_path / "bare.toml"
    table.write_text('[hardware]\nbase = "h100"\nmemory_gib = 40\n')
    bare.write_text('base = "h100"\nmemory_gib = 40\n')
    assert load_hardware(str(table)).memory_gib == 40
    assert load_hardware(str(bare)).memory_gib == 40
