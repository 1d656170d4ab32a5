"""`longctx checkpoint verify` prints verify_command's lines (issue 53 item 10.1), not the manifest's dict."""

from test_untruths_verify import _checkpoint

from longctx.cli import main


def test_the_command_prints_readable_lines(tmp_path, capsys):
    _checkpoint(tmp_path)
    assert main(["checkpoint", "verify", str(tmp_path / "checkpoints")]) == 0
    out = capsys.readouterr().out
    assert "{" not in out and "head 2 x ctx 2, head-first" in out
    assert out.splitlines()[-1].startswith("OK: step 7, all 3 files intact")
