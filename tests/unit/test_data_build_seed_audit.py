"""`longctx data build --seed`: a negative one is refused with the options, before the scan."""

from __future__ import annotations

import pytest

from longctx.data.builder.options import BuildOptions, check_options
from longctx.errors import DataError


def test_a_negative_build_seed_is_refused_before_any_work(tmp_path):
    """It was accepted, and the build stopped after its scan and dedup with numpy's traceback (default_rng takes
    no negative seed)."""
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(DataError, match="--seed must be >= 0, got -1"):
        check_options(BuildOptions([str(tmp_path)], str(tmp_path / "out"), 64, seed=-1))
    check_options(BuildOptions([str(tmp_path)], str(tmp_path / "out"), 64, seed=0))
