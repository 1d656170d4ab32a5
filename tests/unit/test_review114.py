"""Review of names114 / plan114 (review114): what a user reads of a model.

1. A MoE run's training line ("model: ...") said only its total parameters, where generate and eval (and a draft's
   target on the same line) say a MoE model's active ones too: config/model_name.py's one line, as its commit says.
2. generate's speculative line named a plain draft read from hf:DIR twice: "llama DIR (...) from hf:DIR".

Counts expected here come from a model built on the meta device (numel), not from the cost model the code uses."""

from types import SimpleNamespace

import pytest
import torch

from longctx.config import load_config
from longctx.models.llama import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

DIMS = SimpleNamespace(dp_replicate=1, dp_shard=1, head=1, ctx=1, window=0, placement="head-first", expert=1)


def _millions(n: float) -> str:
    return f"{n / 1e6:.3g}M"


def test_a_moe_runs_model_line_says_its_active_parameters_as_generate_does():
    from longctx.train.run_lines import describe_run

    cfg = load_config(None, ["--model.preset=debug-moe", "--train.seq_len=32", "--train.eval_interval=0"])
    model = build_model(cfg.model, device="meta")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".feed_forward.experts." in n)
    m = cfg.model
    active = total - experts * (m.moe_experts - m.moe_top_k) / m.moe_experts  # (each token: top_k of the experts)
    assert active < total * 0.6  # (far apart: a line that says only the total cannot pass)
    line = describe_run(cfg, 1, DIMS, model, torch.device("cpu"), torch.float32, "peak P")[0]
    assert line.startswith(f"model: debug-moe ({_millions(total)} parameters, {_millions(active)} active), cpu"), line


def test_a_plain_draft_from_a_hugging_face_directory_is_named_with_its_directory_once(tmp_path):
    from longctx.generate.drafts import draft_label
    from longctx.models.hf import save_hf

    small = load_config(None, ["--model.layers=1", "--model.dim=32", "--model.ffn_dim=64", "--train.seq_len=32",
                               "--train.eval_interval=0"])
    model = build_model(small.model, seed=1)
    hf = save_hf(model, tmp_path / "draft_hf")
    spec = f"hf:{hf}"
    draft_cfg = load_config(None, {"model": {"init_from": spec}, "train": {"seq_len": 2, "eval_interval": 0}})
    label = draft_label(draft_cfg, spec, model)
    count = sum(p.numel() for p in model.parameters())
    assert label == f"llama {hf} ({_millions(count)} parameters)", label
    assert label.count(str(hf)) == 1, label
