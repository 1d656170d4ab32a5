"""`longctx eval` on a Mixture-of-Experts model: a sequence's score never depends on what it is batched
with. A capacity (moe.capacity_factor > 0) is shared by the tokens of one forward, so eval scores such
a model dropless (and says so); the Sinkhorn router's balanced assignment is training's only (in
evaluation it routes each token by its own top-k)."""

import pytest
import torch

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.eval.request import prepare
from longctx.eval.score_mode import evaluate_score
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 60
MOE = ["--model.preset=debug-moe", "--model.layers=2", "--model.moe.dense_layers=", "--model.ffn_dim=128"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(an hf:DIR of a random two-layer Mixtral-shaped MoE, a text file for filler)."""
    tmp = tmp_path_factory.mktemp("moe")
    cfg = load_config(overrides=[*MOE, "--model.family=mixtral", "--model.moe.norm_topk=true"]).model
    hf = save_hf(build_model(cfg, seed=1), tmp / "hf")
    text = tmp / "filler.py"
    text.write_text(TEXT)
    return hf, text


def _score(folder, task: str, batch: int, *extra):
    hf, text = folder
    more = ["--depths", "0,0.5,1", "--samples", "2"] if task != "ppl" else ["--samples", "3", "--buckets", "4"]
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--lengths", "128", *more,
         "--data", str(text), "--batch", str(batch), *extra])
    request = prepare(args, rest, 1)
    return request, evaluate_score(request, args)


@pytest.mark.parametrize("task", ["passkey", "ppl"])
def test_a_capacity_model_scores_the_same_at_any_batch(folder, task):
    """With a capacity, each expert's room was shared by every token of the forward (--batch 4's four
    sequences, or the unscored copies that fill the last batch): scored dropless, --batch 1 and 4 agree."""
    runs = {b: _score(folder, task, b, "--model.moe.capacity_factor=1.0") for b in (1, 4)}
    one, four = runs[1][1], runs[4][1]
    if task == "ppl":
        assert one["results"][0]["loss"] == pytest.approx(four["results"][0]["loss"], abs=1e-6)
        assert [b["loss"] for b in one["results"][0]["buckets"]] == pytest.approx(
            [b["loss"] for b in four["results"][0]["buckets"]], abs=1e-6)
    else:
        assert [r["answer_nll"] for r in one["results"]] == pytest.approx(
            [r["answer_nll"] for r in four["results"]], abs=1e-6)
    request = runs[1][0]
    assert request.cfg.model.moe_capacity_factor == 0.0
    assert any("dropless" in note for note in request.notes)  # said once, before work
    assert "dropless" in one["routing"]  # and in the JSON


def test_a_dropless_model_is_left_alone(folder):
    request, result = _score(folder, "passkey", 1)
    assert request.cfg.model.moe_capacity_factor == 0.0
    assert not any("dropless" in note for note in request.notes) and "routing" not in result


def test_sinkhorn_routes_each_token_alone_in_evaluation():
    """S-BASE's balanced assignment reads every token of a call, but only in training: the model eval
    builds is in evaluation, where the Sinkhorn router takes each token's top-k, so a sequence scores the
    same alone or batched."""
    cfg = load_config(overrides=[*MOE, "--model.moe.router=sinkhorn"]).model
    model = build_model(cfg, seed=0).eval()
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand(4, 64)
    with torch.no_grad():
        together = model(tokens, positions, None, labels=tokens, loss_reduction="tokens")[..., 0]
        alone = torch.cat([model(tokens[i:i + 1], positions[i:i + 1], None, labels=tokens[i:i + 1],
                                 loss_reduction="tokens")[..., 0] for i in range(4)])
    assert torch.allclose(together, alone, atol=1e-5)
