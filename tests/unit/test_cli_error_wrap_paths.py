"""An error's text is wrapped to 100 columns at spaces only: a path in it stays whole, to copy. Broken at its
hyphens (textwrap's default), a path such as pytest's popen-gw0 or a run directory 20261205-141302-debug read
'popen- gw0' across two lines (found by a test whose tmp path grew past the wrap, 2026-12-05)."""

from longctx.cli import main


def test_a_hyphenated_path_in_an_error_is_not_broken(tmp_path, capsys):
    deep = tmp_path / "a-run-directory-with-hyphens" / "20261205-141302-debug-and-a-long-tail" / "plan-out.toml"
    assert main(["plan", "--model", "debug", "--gpus", "2", "--seq-len", "4096", "--hardware", "h100",
                 "--out", str(deep), "--no-write"]) == 2
    err = capsys.readouterr().err
    assert str(deep) in err, err
    assert max(len(line) for line in err.splitlines() if str(deep) not in line) <= 100
