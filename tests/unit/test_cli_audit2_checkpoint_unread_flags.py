"""`longctx checkpoint ACTION` refuses what ACTION does not read. verify checks one checkpoint and took an OUT, --out,
--dtype, --force, --to and --max-shard-gb without a word (`verify runs/a runs/b` printed OK for a alone, and b read
as verified); import ignored --to and --max-shard-gb (an export flag: the import wrote its own shards)."""

import pytest
from test_untruths_verify import _checkpoint

from longctx.cli import main


@pytest.mark.parametrize("extra, named", [
    (["SECOND"], "SECOND"),  # (a second checkpoint to verify: only the first was)
    (["--out", "o"], "--out o"),
    (["--dtype", "bf16"], "--dtype bf16"),
    (["--force"], "--force"),
    (["--to", "gguf"], "--to gguf"),
    (["--max-shard-gb", "2"], "--max-shard-gb 2"),
])
def test_verify_refuses_what_it_does_not_read(tmp_path, capsys, extra, named):
    _checkpoint(tmp_path)
    argv = ["checkpoint", "verify", str(tmp_path / "checkpoints"), *extra]
    assert main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert named in err and "verify" in err


@pytest.mark.parametrize("extra, named", [(["--to", "gguf"], "--to gguf"),
                                          (["--max-shard-gb", "2"], "--max-shard-gb 2")])
def test_import_refuses_the_export_flags(tmp_path, capsys, extra, named):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert main(["checkpoint", "import", str(gguf), str(tmp_path / "out"), *extra]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert named in err and "export" in err
    assert not (tmp_path / "out").exists()


def test_flags_at_their_defaults_and_verify_alone_still_run(tmp_path, capsys):
    _checkpoint(tmp_path)
    assert main(["checkpoint", "verify", str(tmp_path / "checkpoints")]) == 0
    assert main(["checkpoint", "verify", str(tmp_path / "checkpoints"), "--to", "hf", "--max-shard-gb", "5"]) == 0
