"""`longctx eval --data DIR` where DIR holds text files, not a store: the refusal names the way to read them
(a quoted glob, each file one document: docs/eval.md), not only a store, one text file or the default corpus,
which sent a user with a folder of held-out texts to build a store."""

import pytest

from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import DataError
from longctx.eval.tasks import load_source


def test_a_directory_of_text_files_is_pointed_to_the_glob(tmp_path):
    (tmp_path / "a.txt").write_text("some held-out text\n" * 10)
    with pytest.raises(DataError, match=r"glob of its text files.*--data '.*\*\*/\*\.txt'"):
        load_source(str(tmp_path), "eval", ByteTokenizer(), lambda: None)
    # (the glob it names reads the folder)
    source = load_source(f"{tmp_path}/**/*.txt", "eval", ByteTokenizer(), lambda: None)
    assert len(source.stream(10_000)) == len("some held-out text\n" * 10)
