"""A context-extension flag given to `longctx eval` reaches the model it scores, not only the result's `rope`
record (tests/unit/test_eval_generate_mode.py pins the record; generation's loads are pinned by
test_rope_extension_audit.py): `--model.rope_scaling=yarn --model.rope_factor=4` on weights of 128 positions,
scored at 512, gives transformers' own yarn model's loss over the same weights (float64, one plain forward),
and not the unscaled model's."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.eval.request import prepare
from longctx.eval.score_mode import evaluate_score
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

transformers = pytest.importorskip("transformers")

ORIGINAL, LENGTH = 128, 512
YARN = ["--model.rope_scaling=yarn", "--model.rope_factor=4", f"--model.rope_original_max_len={ORIGINAL}"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ropeeval")
    cfg = load_config(overrides=["--model.layers=1", "--model.dim=64", "--model.heads=4", "--model.kv_heads=2",
                                 "--model.ffn_dim=128", f"--model.max_seq_len={ORIGINAL}",
                                 f"--train.seq_len={ORIGINAL}"]).model
    model = build_model(cfg, seed=2)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # (unit-scale weights: logits far from uniform, so a position's rotation shows in the loss)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 if "embeddings" in name else 2 / p.shape[1] ** 0.5))
    hf = save_hf(model, tmp / "hf")
    text = tmp / "text.py"
    text.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    return hf, text


def _reference_loss(hf, spans, rope_scaling) -> float:
    config = json.loads((Path(hf) / "config.json").read_text())
    theta = (config.pop("rope_parameters", None) or {}).get("rope_theta", config.get("rope_theta"))
    config.update(rope_theta=theta, rope_scaling=rope_scaling)  # (the classic form: transformers 4 and 5 read it)
    config = transformers.AutoConfig.for_model(**config)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float64).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for seq in spans:
            tokens = torch.as_tensor(np.asarray(seq.tokens), dtype=torch.long)[None]
            lp = torch.log_softmax(ref(tokens).logits[0].double(), dim=-1)
            nll -= lp[torch.arange(LENGTH - 1), tokens[0, 1:]].sum().item()  # (the last position predicts nothing)
            n += LENGTH - 1
    return nll / n


def test_a_yarn_flag_is_the_scaling_the_scores_are_computed_with(folder):
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", "ppl", "--data", str(text),
         "--lengths", str(LENGTH), "--samples", "2", "--buckets", "2", *YARN])
    request = prepare(args, rest, 1)
    out = evaluate_score(request, args)
    loss = out["results"][0]["loss"]
    yarn = _reference_loss(hf, request.sequences[LENGTH],
                           {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})
    plain = _reference_loss(hf, request.sequences[LENGTH], None)
    assert abs(yarn - plain) > 1e-3  # (the scaling changes the figure: the check below can tell them apart)
    assert loss == pytest.approx(yarn, abs=2e-5)
    assert out["rope"]["scaling"] == "yarn" and out["rope"]["factor"] == 4.0
