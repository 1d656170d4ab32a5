"""An output path that is a symlink (durable.py check_output_path): open() writes the file the link names, and
generate's --output lines go to FILE.partial beside that file (generate/output.py), so the directory checked before
any work is the link target's. A link into a missing directory passed the check (the link's own directory exists)
and generate stopped with a raw FileNotFoundError on FILE.partial after the weights had loaded."""

import os

import pytest

from longctx.durable import check_output_path
from longctx.errors import ConfigError


def test_a_link_into_a_missing_directory_is_refused_before_work(tmp_path):
    link = tmp_path / "out.jsonl"
    os.symlink(tmp_path / "gone" / "out.jsonl", link)
    with pytest.raises(ConfigError, match=r"out.jsonl \(a link to .*gone/out.jsonl\) cannot be written: .*gone does "
                                          r"not exist"):
        check_output_path("--output", str(link), {})
    with pytest.raises(ConfigError, match="gone does not exist"):  # (eval makes the link's parents, not the target's)
        check_output_path("--output", str(link), {}, create_parents=True)


def test_links_that_can_be_written_and_devices_are_accepted(tmp_path):
    (tmp_path / "real").mkdir()
    to_new, to_file = tmp_path / "new.jsonl", tmp_path / "file.jsonl"
    os.symlink(tmp_path / "real" / "new.jsonl", to_new)  # (dangling: the file it names is made)
    (tmp_path / "real" / "old.jsonl").write_text("x\n")
    os.symlink(tmp_path / "real" / "old.jsonl", to_file)
    for path in (to_new, to_file, "/dev/null", "/dev/stdout"):
        check_output_path("--output", str(path), {})
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["old.jsonl"]  # (no probe left behind)


def test_a_writer_that_renames_over_the_path_checks_the_links_own_directory(tmp_path):
    """eval's --output is written by write_text_durably, a rename over the path (the link itself replaced): the
    link's target directory does not matter there, and is not asked for."""
    link = tmp_path / "out.json"
    os.symlink(tmp_path / "gone" / "out.json", link)
    check_output_path("--output", str(link), {}, create_parents=True, renames=True)
