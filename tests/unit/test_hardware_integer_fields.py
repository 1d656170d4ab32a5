"""Integer hardware fields (dtype_bytes, group_ranks) given as non-integers were truncated without a
word: `--hw dtype_bytes=2.5` planned with 2, and so did `dtype_bytes = 2.5` in a hardware TOML file.
Now refused with the field named; whole numbers written as floats (2.0) still read."""

import pytest

from longctx.costs.hardware import load_hardware
from longctx.errors import ConfigError


@pytest.mark.parametrize("item", ["dtype_bytes=2.5", "group_ranks=1.5"])
def test_non_integer_override_is_refused(item):
    with pytest.raises(ConfigError, match=f"'{item.split('=')[0]}' must be a whole number"):
        load_hardware("h100", [item])


def test_non_integer_in_a_hardware_file_is_refused(tmp_path):
    based, complete = tmp_path / "based.toml", tmp_path / "complete.toml"
    based.write_text('[hardware]\nbase = "h100"\ndtype_bytes = 2.5\n')
    complete.write_text('[hardware]\nname = "x"\nmemory_gib = 80\npeak_tflops = 900\nintra_gbps = 400\n'
                        'inter_gbps = 50\nhost_link_gbps = 50\nhost_memory_gib = 1024\ndtype_bytes = 2.5\n')
    for f in (based, complete):
        with pytest.raises(ConfigError, match="'dtype_bytes' must be a whole number"):
            load_hardware(str(f))


def test_whole_numbers_still_read(tmp_path):
    assert load_hardware("h100", ["dtype_bytes=4.0"]).dtype_bytes == 4
    assert isinstance(load_hardware("h100", ["dtype_bytes=4"]).dtype_bytes, int)
    f = tmp_path / "hw.toml"
    f.write_text('[hardware]\nbase = "h100"\ndtype_bytes = 4\nmemory_gib = 40.5\n')
    hw = load_hardware(str(f))
    assert hw.dtype_bytes == 4 and hw.memory_gib == 40.5
