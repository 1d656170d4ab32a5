"""Audit regressions: a linear-RoPE export read back reaches what it trained on (config.json gives the length
before the factor); an OLMoE transformers cannot build is refused by the export; a commit killed while it
re-saves an existing step leaves that step's complete checkpoint in place."""

import json
import os
import subprocess
import sys

from longctx.config import load_config
from longctx.config.hf_export import export_problems
from longctx.config.positions import trained_positions
from longctx.models.hf import load_hf, save_hf
from longctx.models.llama import build_model


def _linear():
    return load_config(overrides=["--model.preset=debug", "--model.rope_scaling=linear", "--model.rope_factor=4",
                                  "--train.seq_len=256", "--model.max_seq_len=1024"]).model


def test_a_linear_export_reads_back_with_the_reach_it_trained_on(tmp_path):
    cfg = _linear()
    save_hf(build_model(cfg, seed=1), tmp_path / "a", trained_positions=256)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["max_position_embeddings"] == 64
    assert trained_positions(f"hf:{tmp_path / 'a'}").positions == 256
    m = load_config(overrides=[f"--model.init_from=hf:{tmp_path / 'a'}", "--train.seq_len=256"]).model
    assert m.max_seq_len == 256 and load_hf(tmp_path / "a").cfg.max_seq_len == 256
    save_hf(build_model(cfg, seed=1), tmp_path / "b")  # (no record: max_seq_len, written before the factor)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["max_position_embeddings"] == 256
    assert trained_positions(f"hf:{tmp_path / 'b'}").positions == 1024


def test_an_olmoe_whose_heads_are_not_dim_wide_is_refused_by_the_export():
    cfg = load_config(overrides=["--model.preset=debug-moe", "--model.family=olmoe", "--model.qk_norm=true",
                                 "--model.qk_norm_span=all", "--model.moe.norm_topk=false", "--model.head_dim=48",
                                 "--model.moe.expert_dim=0", "--model.moe.shared_experts=0",
                                 "--model.moe.dense_layers=", "--train.seq_len=256"]).model
    assert any("hidden_size" in p for p in export_problems(cfg))


CHILD = r'''
import os, sys, torch
from pathlib import Path
import longctx.checkpoint.manager as M
root, phase = Path(sys.argv[1]), sys.argv[2]
model = torch.nn.Linear(4, 4); opt = torch.optim.AdamW(model.parameters())
mgr = M.CheckpointManager(root, keep=5, async_save=False, rank=0, world=1, layout={"world": 1}, model_cfg={},
                          log=lambda *a: None)
if phase == "first":
    mgr.save(2, model, opt, {}); mgr.save(4, model, opt, {})
elif phase == "resave":
    M.publish = lambda tmp, final: os._exit(9)
    mgr.save(4, model, opt, {})
else:
    print(M.resume_candidates(root)[0].name)
'''


def test_a_commit_killed_while_it_replaces_a_step_keeps_that_step(tmp_path):
    root, env = tmp_path / "ck", {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(phase):
        return subprocess.run([sys.executable, "-c", CHILD, str(root), phase], env=env, capture_output=True,
                              text=True)

    assert run("first").returncode == 0
    assert run("resave").returncode == 9 and not (root / "step-00000004").exists()
    out = run("restart")
    assert out.stdout.strip() == "step-00000004", out.stderr
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000004"]


def test_a_linear_config_in_transformers_5_form_defaults_to_its_reach(tmp_path):
    """rope_parameters (transformers 5's config.json) as rope_scaling: max_position_embeddings x the factor."""
    base = load_config(overrides=["--model.preset=debug", "--train.seq_len=64"]).model
    for form in ("rope_scaling", "rope_parameters"):
        hf = save_hf(build_model(base, seed=0), tmp_path / form)
        config = json.loads((hf / "config.json").read_text())
        theta = config.pop("rope_theta", 10000.0)
        config.pop("rope_scaling", None)
        config.pop("rope_parameters", None)
        config["max_position_embeddings"] = 64
        if form == "rope_scaling":
            config["rope_theta"], config["rope_scaling"] = theta, {"rope_type": "linear", "factor": 4.0}
        else:
            config["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": theta}
        (hf / "config.json").write_text(json.dumps(config))
        m = load_config(overrides=[f"--model.init_from=hf:{hf}", "--train.seq_len=256"]).model
        assert (m.rope_scaling, m.max_seq_len) == ("linear", 256), form
