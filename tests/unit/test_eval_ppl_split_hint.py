"""ppl's "no document long enough" error suggests --split train only where --split applies: a store's eval
split (a text --data refuses --split)."""

import numpy as np
import pytest

from longctx.errors import DataError
from longctx.eval.tasks import TokenSource, ppl_sequences


def _source(description):
    return TokenSource(lambda: iter([np.arange(6)]), description)


def test_a_text_file_is_not_told_to_use_another_split():
    with pytest.raises(DataError) as e:
        ppl_sequences(_source("f.txt (text file)"), 128, 2)
    assert "--split" not in str(e.value) and "shorter --lengths" in str(e.value)


def test_a_stores_eval_split_is_told_to_use_the_train_split():
    with pytest.raises(DataError) as e:
        ppl_sequences(_source("stores/a (eval split, 3 documents)"), 128, 2)
    assert "another split (--split train)" in str(e.value)
