"""`longctx checkpoint export CHECKPOINTS OUT` says which step it exported. A checkpoints directory whose
`latest` names a step that is missing or incomplete (a copy still under way, a manifest lost) exports the newest
complete one, an older step than the one asked for, and the export said nothing of it ("wrote OUT (fp32; ...)"),
where generate and eval name the step they read and that it is not the one `latest` names."""

import pytest

pytest.importorskip("transformers")
from test_export_audit import checkpoint  # noqa: E402

from longctx.cli import main  # noqa: E402


def test_the_step_exported_is_said_and_a_skipped_latest_too(tmp_path, capsys):
    step = checkpoint(tmp_path, "byte")
    root = step.parent
    (root / "latest").write_text(step.name + "\n")
    assert main(["checkpoint", "export", str(root), str(tmp_path / "a")]) == 0
    assert f"from {root} (step 1) (fp32;" in capsys.readouterr().out

    torn = root / "step-00000002"  # (no manifest.json: not a complete checkpoint)
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"partial")
    (root / "latest").write_text(torn.name + "\n")
    assert main(["checkpoint", "export", str(root), str(tmp_path / "b")]) == 0
    said = capsys.readouterr().out
    assert "(step 1, the newest complete one: its `latest` names step-00000002, which is missing or incomplete)" \
        in said
