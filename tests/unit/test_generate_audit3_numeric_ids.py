"""Two --prompts lines whose "id"s are one JSON number written two ways (1 and 1.0, 100 and 1e2, 0 and
-0.0, or inside a list) are one id twice, refused as any repeated id is. JSON has one number type: a
reader of the output (Python's dict, JavaScript, pandas) takes 1 and 1.0 as the same id, so the two
prompts' continuations could not be told apart when joined back. Before this audit the ids were compared
by their JSON text, which differs, and both lines were generated. A string and a number ("1" and 1) and a
boolean and a number (true and 1) stay two ids, as before."""

import json
from types import SimpleNamespace

import pytest

from longctx.errors import ConfigError
from longctx.generate.prompts import read_prompts


def _read(tmp_path, ids):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "x", "id": {i}}}\n' for i in ids))
    return read_prompts(SimpleNamespace(prompt=None, prompts=str(path), chat=False))


@pytest.mark.parametrize("ids", [["1", "1.0"], ["100", "1e2"], ["0", "-0.0"], ["[1, 2]", "[1.0, 2]"],
                                 ['{"a": 3}', '{"a": 3.0}']])
def test_one_number_written_two_ways_is_one_id(tmp_path, ids):
    with pytest.raises(ConfigError, match="gives one id to several prompts: id .* on lines 1, 2"):
        _read(tmp_path, ids)


@pytest.mark.parametrize("ids", [['"1"', "1"], ["true", "1"], ["1", "1.5"], ["1e300", "1e301"], ["2", "[2]"]])
def test_different_ids_stay_different(tmp_path, ids):
    got = _read(tmp_path, ids)
    assert [p["id"] for p in got] == [json.loads(i) for i in ids]  # (written as given)
