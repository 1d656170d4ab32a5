"""A --config saved as UTF-8 with a byte-order mark (Notepad's "UTF-8 with BOM", Windows PowerShell's
`Out-File -Encoding utf8`) is UTF-8 text, as TOML asks, but was refused as "not valid TOML: Invalid statement (at
line 1, column 1)", naming nothing the user could see in the file. The mark is skipped; UTF-16 is still refused
with the encoding named."""

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError


def test_a_config_with_a_utf8_byte_order_mark_loads(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 3\n")
    assert load_config(path, []).train.steps == 3


def test_a_utf16_config_is_still_said_as_another_encoding(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_bytes("[train]\nsteps = 3\n".encode("utf-16"))
    with pytest.raises(ConfigError, match="TOML files are UTF-8 text"):
        load_config(path, [])
