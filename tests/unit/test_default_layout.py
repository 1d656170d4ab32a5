"""The default launch's layout follows the model's heads (issue 53): head 2 x ctx N/2 where the heads
split over 2, the context alone where they do not (a 9-head model such as SmolLM2-135M); an explicit
head degree that does not split them names the layouts that would."""

import json
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.config.layout import default_layout  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


def test_default_layout_by_heads():
    assert default_layout(4) == {"head": 2, "ctx": 2}
    assert default_layout(4, heads=32, kv_heads=8) == {"head": 2, "ctx": 2}
    assert default_layout(4, heads=9, kv_heads=3) == {"ctx": 4}
    assert default_layout(8, heads=4, kv_heads=1) == {"head": 2, "ctx": 4}  # kv heads replicated over 2
    assert default_layout(2, heads=9, kv_heads=3) == {"ctx": 2}


def test_a_head_degree_that_does_not_divide_the_heads_names_what_would():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["--model.heads=9", "--model.kv_heads=3", "--model.dim=72", "--parallel.head=2",
                               "--parallel.ctx=2", "--train.seq_len=64"])
    said = " ".join(str(e.value).split())
    assert ("model.heads (9) must be divisible by parallel.head (2); on the same 4 ranks these layouts work: "
            "--parallel.head 1 --parallel.ctx 4 (or --nproc 1)") in said


def test_a_nine_head_hf_model_gets_a_working_default_layout(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(test_hf.hf_config("llama", hidden_size=72, num_attention_heads=9,
                                                                num_key_value_heads=3, max_position_embeddings=4096)))
    r = subprocess.run([sys.executable, "-m", "longctx", "train", "--model.init_from", f"hf:{d}", "--nproc", "4",
                        "--print-config"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "\nhead = 1\n" in r.stdout and "\nctx = 4\n" in r.stdout
