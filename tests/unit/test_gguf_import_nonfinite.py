"""A GGUF file whose weights hold a NaN (a damaged download, a bad conversion): the import's logits check compared
NaN with NaN and said "longctx reads the imported file differently from transformers ... Please report it",
blaming longctx for the file's own values (checkpoint/gguf_import.py check_finite)."""

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
import torch  # noqa: E402
from test_gguf_import import tiny_llama, write_gguf  # noqa: E402

from longctx.checkpoint.gguf_import import GGUFImportError, import_gguf  # noqa: E402


def test_a_file_with_a_nan_weight_is_refused_naming_the_tensor(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    source = write_gguf(model, tmp_path / "nan.gguf")
    with pytest.raises(GGUFImportError, match=r"not finite.*model\.layers\.1\.mlp\.down_proj\.weight") as e:
        import_gguf(source, tmp_path / "out")
    assert "report it" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.gguf"]  # no OUT, no temporary
