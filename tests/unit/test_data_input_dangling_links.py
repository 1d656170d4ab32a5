"""A link in an input directory whose target is gone (`books -> /mnt/books` with the volume not mounted, a file
moved away) was passed over without a word: its documents were missing from the store, the build said "nothing
skipped". A directory that cannot be listed is refused for the same reason (inputs.py _walk); so is such a link.
A dotfile link (an editor's lock file, `.#notes.txt`, points nowhere by design) is not read, as any dotfile."""

import os

import pytest

from longctx.data.builder import inputs
from longctx.errors import DataError


def _corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "own").mkdir(parents=True)
    (root / "own" / "a.txt").write_text("a document of its own")
    return root


def test_a_link_to_a_missing_directory_is_refused(tmp_path):
    root = _corpus(tmp_path)
    os.symlink(tmp_path / "unmounted" / "books", root / "books")
    with pytest.raises(DataError, match=r"'.*corpus/books' is a link to '.*unmounted/books', which does not exist"):
        inputs.input_files(str(root))


def test_a_link_to_a_missing_file_is_refused(tmp_path):
    root = _corpus(tmp_path)
    os.symlink(tmp_path / "gone.txt", root / "own" / "b.txt")
    with pytest.raises(DataError, match=r"own/b.txt' is a link to .*gone.txt', which does not exist"):
        inputs.input_files(str(root))


def test_a_dotfile_link_to_nothing_is_passed_over_as_dotfiles_are(tmp_path):
    root = _corpus(tmp_path)
    os.symlink("user@host.1234:1700000000", root / "own" / ".#a.txt")  # (what Emacs leaves beside a file it edits)
    found = [f.relative_to(root).as_posix() for f in inputs.input_files(str(root))[1]]
    assert found == ["own/a.txt"]
