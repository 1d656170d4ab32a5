"""An input directory at the root of its own filesystem (`--input /mnt/corpus`) holds fsck's lost+found, root's
and unlistable by a user: the walk that follows symlinked directories refused every build of it ('cannot be
listed ... move it out of the input'), where the walk before passed over it. It is no corpus: not read, at a mount
point; a lost+found elsewhere is an ordinary directory, and one that cannot be listed is still refused."""

import os

import pytest

from longctx.data.builder import inputs
from longctx.errors import DataError


@pytest.fixture
def volume(tmp_path, monkeypatch):
    """tmp_path as a mount point, with fsck's lost+found, and a books/lost+found that is an ordinary directory."""
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "lost+found" / "#1234.txt").write_text("an orphaned inode's bytes, named as text")
    (tmp_path / "books" / "lost+found").mkdir(parents=True)
    (tmp_path / "books" / "a.txt").write_text("a document")
    (tmp_path / "books" / "lost+found" / "b.txt").write_text("a document in a directory of that name")
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.realpath(p) == str(tmp_path.resolve()) or real(p))
    return tmp_path


def _unlistable(monkeypatch, directory):
    """`directory` cannot be listed, as a directory of root's mode 700 for a user who is not root."""
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path) == str(directory):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)
    monkeypatch.setattr(os, "scandir", refusing)


def _files(volume):
    return [f.relative_to(volume).as_posix() for f in inputs.input_files(str(volume))[1]]


def test_a_volumes_lost_and_found_is_not_the_corpus(volume):
    assert _files(volume) == ["books/a.txt", "books/lost+found/b.txt"]


def test_an_unlistable_lost_and_found_at_the_mount_point_is_passed_over(volume, monkeypatch):
    _unlistable(monkeypatch, volume / "lost+found")
    assert _files(volume) == ["books/a.txt", "books/lost+found/b.txt"]


def test_an_unlistable_directory_elsewhere_is_still_refused(volume, monkeypatch):
    _unlistable(monkeypatch, volume / "books" / "lost+found")
    with pytest.raises(DataError, match=r"books/lost\+found' cannot be listed"):
        _files(volume)


def test_a_volume_reached_by_a_link_has_its_lost_and_found_passed_over(tmp_path, monkeypatch):
    """`books -> /mnt/books` (a corpus assembled from links), its volume's lost+found unlistable: os.path.ismount
    says False for a symlink's path (its own rule, kept by the fake below), so the walk asked it of the link."""
    vol, corpus = tmp_path / "vol", tmp_path / "corpus"
    (vol / "lost+found").mkdir(parents=True)
    (vol / "a.txt").write_text("a document")
    corpus.mkdir()
    (corpus / "books").symlink_to(vol)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount",
                        lambda p: (not os.path.islink(p) and os.path.realpath(p) == str(vol.resolve())) or real(p))
    _unlistable(monkeypatch, corpus / "books" / "lost+found")
    assert [f.relative_to(corpus).as_posix() for f in inputs.input_files(str(corpus))[1]] == ["books/a.txt"]
