"""Eval and context extension (a helper's audit, 2026-12-02): Ms-PoE's head ratios depended on the run (its
longest --lengths, the weights' dtype); ppl read a text document's start without the BOS its training
documents had; a ppl plot of a diverged model crashed after its JSON; --buckets beyond a length was accepted
(a row and a tensor per bucket)."""

import json
import math

import numpy as np
import pytest
import torch

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.data.tokenizer import ByteTokenizer
from longctx.errors import ConfigError
from longctx.eval.plots import write_plot
from longctx.eval.request import prepare
from longctx.eval.tasks import load_source
from longctx.generate.loading import load_model
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

SHAPE = ["--model.preset=debug", "--model.layers=2", "--model.dim=64", "--model.heads=16", "--model.kv_heads=8",
         "--model.ffn_dim=64"]
MS_POE = ["--model.rope_ms_poe=true", "--model.rope_ms_poe_skip_layers=0"]


def _sharp(model, seed):
    """Weights of a model that attends sharply (random ones rank the heads by rounding noise alone)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 if "embeddings" in name else 2 / p.shape[1] ** 0.5))
    return model


def test_ms_poe_ratios_are_the_weights_whatever_the_dtype_and_the_longest_length(tmp_path):
    """The ranking probe runs on the fp32 weights over the positions they trained on: not in bf16 after the
    cast (4 of 8 such models got other ratios), not over model.max_seq_len, which eval raises to its longest
    --lengths (a length's score then depended on the other lengths evaluated)."""
    for seed in range(4):
        hf = save_hf(_sharp(build_model(load_config(overrides=SHAPE).model, seed=seed), seed), tmp_path / f"{seed}")
        config = json.loads((hf / "config.json").read_text())
        config["max_position_embeddings"] = 256
        (hf / "config.json").write_text(json.dumps(config))
        ratios = {}
        for dtype, longest in ((torch.float32, 256), (torch.bfloat16, 256), (torch.float32, 1024)):
            cfg = load_config(overrides=[*SHAPE, f"--model.init_from=hf:{hf}", *MS_POE, "--train.seq_len=256",
                                         f"--model.max_seq_len={longest}"])
            ratios[dtype, longest] = load_model(cfg, torch.device("cpu"), dtype).ms_poe_ratios
        first = ratios[torch.float32, 256]
        assert all(torch.equal(first, r) for r in ratios.values()), (seed, ratios)


def test_a_text_documents_ppl_spans_begin_with_the_models_prefix(tmp_path):
    (tmp_path / "doc.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    tokens = np.concatenate(list(load_source(str(tmp_path / "doc.txt"), "eval", ByteTokenizer(), None, [7])
                                 .documents()))
    assert tokens[0] == 7 and bytes(tokens[1:10].astype(np.uint8)) == b"def f(x):"


def test_a_ppl_plot_without_a_finite_loss_is_written():
    result = {"task": "ppl", "model": "m", "results": [{"length": 256, "sequences": 1, "buckets": [
        {"start": 0, "end": 128, "loss": math.nan}, {"start": 128, "end": 256, "loss": None}]}]}
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        assert write_plot(result, Path(d) / "p.png").stat().st_size > 0


def _prepare(tmp_path, *flags):
    (tmp_path / "doc.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    hf = tmp_path / "hf"
    if not hf.exists():
        save_hf(build_model(load_config(overrides=SHAPE).model, seed=0), hf)
    args, rest = build_parser("eval").parse_known_args(["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte",
                                                        "--task", "ppl", "--data", str(tmp_path / "doc.txt"),
                                                        "--samples", "1", *flags])
    return prepare(args, rest, 1), args


def test_more_ppl_buckets_than_positions_are_refused_and_the_default_fits_a_short_length(tmp_path):
    with pytest.raises(ConfigError, match="--buckets 100 is more than the 64 positions"):
        _prepare(tmp_path, "--lengths", "64", "--buckets", "100")
    from longctx.eval.score_mode import evaluate_score

    request, args = _prepare(tmp_path, "--lengths", "8,64")  # (the default 16 at 8 tokens: 8 there, 16 at 64)
    out = evaluate_score(request, args)
    assert [len(r["buckets"]) for r in out["results"]] == [8, 16]
