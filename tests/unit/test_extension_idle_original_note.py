"""Extending weights at model.init_from with `--model.rope_scaling=yarn --model.rope_factor=4` and no
rope_original_max_len: the scaling stretches from the schema's default 8,192, past the 64 positions these weights
learned, so it extends nothing (yarn keeps every wavelength shorter than the original; generate refuses the
model's longer prompts for it, config/positions.py idle_original). Training said only "rope_scaling 'none' ->
'yarn', rope_factor 8.0 -> 4.0" (docs/checkpoints.md: the scaling is logged "with its factor and original
length") and trained on without a word. Now the setup line names the original length it stretches and notes
that it stretches nothing, with the flag that extends; a scaling over the weights' own length says no note."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.train.trainer import Trainer  # noqa: E402

RUN = ["--train.warmup_steps=1", "--train.eval_interval=0", "--data.max_docs=60", "--metrics.progress=false",
       "--metrics.plots=false", "--train.global_batch=2", "--data.tokenizer=byte", "--train.steps=1",
       "--train.seq_len=128", "--model.max_seq_len=256", "--checkpoint.interval=0", "--checkpoint.final=false"]


@pytest.fixture
def weights_of_64(tmp_path):
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                  rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(d / "model.safetensors"))
    return d


def _setup_line(tmp_path, d, *flags) -> str:
    lines = []
    Trainer(load_config(overrides=RUN + [f"--train.run_dir={tmp_path}/run{len(flags)}", f"--model.init_from=hf:{d}",
                                         *flags]), log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return next(line for line in lines if line.startswith("weights: read from"))


def test_a_scaling_over_the_default_original_is_said_to_stretch_nothing(tmp_path, weights_of_64):
    line = _setup_line(tmp_path, weights_of_64, "--model.rope_scaling=yarn", "--model.rope_factor=4")
    assert "model.rope_original_max_len: 8192 (unchanged)" in line
    assert "model.rope_original_max_len 8,192 is past the 64 positions the weights learned unscaled" in line
    assert "--model.rope_original_max_len=64" in line


def test_a_scaling_over_the_weights_length_says_no_note(tmp_path, weights_of_64):
    line = _setup_line(tmp_path, weights_of_64, "--model.rope_scaling=yarn", "--model.rope_factor=4",
                       "--model.rope_original_max_len=64")
    assert "model.rope_original_max_len: 8192 -> 64" in line and "stretches none" not in line
