"""Review of 117's moved-aside resume and positions changes (each failing before its fix).

- `--checkpoint.resume <another run>/checkpoints` whose `latest` names a step a killed re-save left moved aside
  resumed the older step before it, silently (that run's own start never sweeps it): now the step `latest` names is
  put back and resumed, as for the step's own path.
- A moved-aside step that cannot be put back (another user's run, a read-only copy) raised a raw PermissionError
  from the rename, where the resume had said in words that the step is not there: now a CheckpointError that says
  so and how to get it back.
- `longctx train --print-config` with an explicit resume of a moved-aside step (no --nproc) printed the default
  layout's 4 ranks (parallel.head 1 -> 2, ctx 1 -> 2), where the run itself, which puts the step back first, runs
  on the 1 that wrote it: the ranks are read from the moved-aside step's manifest.
- A config.json whose linear RoPE factor is not a positive number is refused when read: with a changed scaling
  (--model.rope_factor 4) its unscaled length was searched for by linear_positions, which never ended for a
  negative factor (covered_positions hung), and a reach of max_position_embeddings x factor is no length.
"""

import json
from pathlib import Path

import pytest
from test_moved_aside117 import STEP4, _copy, _run, killed  # noqa: F401 (the module fixture)

import longctx.train.moved_aside as moved_aside_module
from longctx.cli import main
from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.errors import UserError
from longctx.train.moved_aside import put_back_resumed


def test_another_runs_checkpoints_directory_resumes_the_moved_aside_latest(killed, tmp_path):  # noqa: F811
    run_dir = _copy(killed, tmp_path, "theirs")
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == STEP4 and not (root / STEP4).exists()
    said = []
    _, result = _run(tmp_path / "mine", "--train.steps=6", f"--checkpoint.resume={root}", log=said.append)
    assert result.first_step == 5  # (step 2, the newest complete one, gave 3)
    assert (root / STEP4 / "manifest.json").read_bytes() == killed[1]
    assert any("put back" in line for line in said), said


def test_a_step_that_cannot_be_put_back_is_refused_in_words(killed, tmp_path, monkeypatch):  # noqa: F811
    run_dir = _copy(killed, tmp_path, "readonly")
    root = run_dir / "checkpoints"
    before = sorted(p.name for p in root.iterdir())

    def refused(old):  # what os.replace raises in a directory this user may not write (chattr +i alike)
        raise PermissionError(13, "Permission denied", str(old))

    monkeypatch.setattr(moved_aside_module, "put_back", refused)
    with pytest.raises(CheckpointError) as e:
        put_back_resumed(str(root / STEP4))
    message = str(e.value)
    assert "could not be put back" in message and "Permission denied" in message, message
    assert f"mv {next(root.glob('.tmp-old-*'))} {root / STEP4}" in message, message
    assert sorted(p.name for p in root.iterdir()) == before


def _printed(run_dir, capsys):
    assert main(["train", "--print-config", "--train.device=cpu", f"--train.run_dir={run_dir}",
                 f"--checkpoint.resume={run_dir / 'checkpoints' / STEP4}"]) == 0
    out, err = capsys.readouterr()
    return out.replace(str(run_dir), "RUN"), err.replace(str(run_dir), "RUN")


def test_print_config_of_a_moved_aside_step_is_what_the_run_runs(killed, tmp_path, capsys):  # noqa: F811
    moved, restored = _copy(killed, tmp_path, "moved"), _copy(killed, tmp_path, "restored")
    (old,) = (restored / "checkpoints").glob(".tmp-old-*")
    old.rename(restored / "checkpoints" / STEP4)  # (what the run does before it resolves the layout)
    expected = _printed(restored, capsys)
    assert "nothing changed" in expected[1], expected[1]
    assert _printed(moved, capsys) == expected
    assert not (moved / "checkpoints" / STEP4).exists()  # (--print-config changes nothing)


@pytest.mark.parametrize("factor", [-2.0, 0])
def test_a_config_json_linear_factor_that_is_no_positive_number_is_refused(tmp_path, factor):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 256,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"type": "linear", "factor": factor}, "tie_word_embeddings": False}))
    with pytest.raises(UserError) as e:  # (before: loaded; its reach then hung for -2.0)
        load_config(None, [f"--model.init_from=hf:{hf}", "--model.rope_factor=4", "--model.max_seq_len=2048",
                           "--train.seq_len=64", "--train.device=cpu"])
    assert "factor" in str(e.value) and Path(hf).name in str(e.value), str(e.value)
