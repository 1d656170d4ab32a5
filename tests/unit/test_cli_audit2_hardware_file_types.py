"""A hardware file's (`longctx plan --hardware FILE.toml`) value of the wrong TOML type was converted without a
word: `host_memory_gib = true` planned 1 GiB of host memory per node (float(True)), `dtype_bytes = false` 0 bytes,
and `name = 5` a name of "5". Refused, naming the field and the type expected, as the run config refuses them;
--hw KEY=VALUE strings are still read as numbers."""

import pytest

from longctx.costs.hardware import load_hardware
from longctx.errors import ConfigError


@pytest.mark.parametrize("line, key", [("host_memory_gib = true", "host_memory_gib"),
                                       ("dtype_bytes = false", "dtype_bytes"), ("name = 5", "name")])
def test_a_value_of_the_wrong_type_is_refused(tmp_path, line, key):
    path = tmp_path / "hw.toml"
    path.write_text(f'[hardware]\nbase = "h100"\n{line}\n')
    with pytest.raises(ConfigError, match=key):
        load_hardware(str(path))


def test_numbers_and_flag_strings_still_read(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text('[hardware]\nbase = "h100"\nhost_memory_gib = 512\npeak_tflops = 900.5\nname = "mine"\n')
    hw = load_hardware(str(path), ["dtype_bytes=4", "memory_gib=40"])
    assert (hw.host_memory_gib, hw.peak_tflops, hw.name, hw.dtype_bytes, hw.memory_gib) == (512, 900.5, "mine", 4, 40)
