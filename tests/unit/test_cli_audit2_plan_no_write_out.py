"""`longctx plan --out mine.toml --no-write` planned, printed the table and wrote nothing, without a word: the
--out named was dropped. Refused before planning, as the plan's other flags that would do nothing are."""

from longctx.cli import main

BASE = ["plan", "--model", "debug", "--gpus", "2", "--seq-len", "4096", "--hardware", "h100", "--top", "1"]


def test_an_out_beside_no_write_is_refused(tmp_path, capsys):
    out = tmp_path / "mine.toml"
    assert main([*BASE, "--out", str(out), "--no-write"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--out {out}" in err and "--no-write" in err
    assert not out.exists()


def test_no_write_alone_and_out_alone_still_run(tmp_path, capsys):
    assert main([*BASE, "--no-write"]) == 0
    out = tmp_path / "mine.toml"
    assert main([*BASE, "--out", str(out)]) == 0 and out.is_file()
