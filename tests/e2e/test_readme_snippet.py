"""The README's Python block runs as written (imports, tensors with their shapes and dtypes), with
its placeholder model path pointing at a small random model."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from readme_tour import readme_python  # noqa: E402


def test_the_readme_python_block_runs(tmp_path):
    from longctx.config import load_config
    from longctx.models.hf import save_hf
    from longctx.models.llama import build_model

    blocks = readme_python(ROOT / "README.md")
    assert len(blocks) == 1 and "/path/to/Qwen3-0.6B" in blocks[0]
    model_dir = save_hf(build_model(load_config(overrides=["--model.layers=1"]).model), tmp_path / "model")
    code = blocks[0].replace("/path/to/Qwen3-0.6B", str(model_dir))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "qwen3-copy" / "config.json").is_file()
