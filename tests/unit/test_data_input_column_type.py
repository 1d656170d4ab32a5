"""A parquet or arrow file whose text column holds no strings (bytes, numbers) had every row skipped as
"no text field", the column being right there: the build ended with "hold no usable document (2 skipped: 2 no
text field)", or, beside other inputs, passed the file over with that count. It is refused, naming the
column's type, as a file without the column is; a string column with nulls still skips its null rows. Two columns
of the name were read as the last (arrow) or the first (parquet) without a word: refused too."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from longctx.data.builder.readers import iter_file
from longctx.errors import DataError


def _read(path, **kw):
    from collections import Counter
    skipped = Counter()
    return [d.text for d in iter_file(path, path.name, "text", skipped, **kw)], dict(skipped)


@pytest.mark.parametrize("values,kind", [([b"bytes one", b"bytes two"], "binary"), ([1, 2], "int64"),
                                         ([["a", "b"], ["c"]], r"list<\w+: string>")])
def test_a_parquet_text_column_without_strings_is_refused(tmp_path, values, kind):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": values}), path)
    with pytest.raises(DataError, match=rf"column 'text' holds {kind} values, not text.*--text-field"):
        _read(path)


def test_an_arrow_text_column_without_strings_is_refused(tmp_path):
    path = tmp_path / "x.arrow"
    table = pa.table({"text": pa.array([b"one"], pa.large_binary())})
    with pa.ipc.new_stream(str(path), table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r"column 'text' holds large_binary values, not text"):
        _read(path)


def test_string_columns_are_read_and_their_nulls_skipped(tmp_path):
    path = tmp_path / "x.parquet"
    texts = pa.array(["a", None, "b", "a"])
    pq.write_table(pa.table({"text": texts, "dict": texts.dictionary_encode(),
                             "large": pa.array(["c", "d"] * 2, pa.large_string())}), path)
    assert _read(path) == (["a", "b", "a"], {"missing_text_field": 1})
    from collections import Counter
    for field, want in (("dict", ["a", "b", "a"]), ("large", ["c", "d", "c", "d"])):
        assert [d.text for d in iter_file(path, "x", field, Counter())] == want


def test_an_arrow_file_with_two_text_columns_is_refused(tmp_path):
    """Two columns of the name: the row's index of it was -1 (pyarrow's "none"), read as the last column."""
    path = tmp_path / "x.arrow"
    table = pa.Table.from_arrays([pa.array(["the text"]), pa.array(["the other"])], names=["text", "text"])
    with pa.ipc.new_stream(str(path), table.schema) as w:
        w.write_table(table)
    with pytest.raises(DataError, match=r"has 2 columns named 'text'"):
        _read(path)
