"""Windowed weights (Mistral-7B-v0.1: sliding_window 4,096, max_position_embeddings 32,768) without
--model.max_seq_len (helper audit after test_swa_window_audit.py, test_swa_eval_audit.py).

model.max_seq_len defaulted to max_position_embeddings, which the window's rule refused at config load: so
`longctx generate --checkpoint hf:MISTRAL --prompt hi`, `longctx eval --lengths 1K` and `longctx train` from the
weights were all refused, however short, until the user added --model.max_seq_len 4096 (and the message spoke of
training to generate / eval). Now the length defaults to the window where it binds (config/hf.py
default_max_seq_len); within it the tokens and losses are transformers' (the window applied); past it every command
still refuses at the point of work, and a --model.max_seq_len given past it is refused as before. eval --mode
generate --context-memory infllm (every distance within the window) at lengths past the window raised max_seq_len
to the longest length itself, into that refusal: no longer."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_swa_eval_audit import W, transformers_nll, windowed_model  # noqa: E402

from longctx.cli import build_parser  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.hf import HFFormatError  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """The windowed Mistral of test_swa_eval_audit (a 16-token window; test_hf's max_position_embeddings 256)."""
    return windowed_model(tmp_path_factory.mktemp("swa_default"))


def _generate(d, *extra):
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", *extra])
    return prepare(args, rest)


def test_generate_without_max_seq_len_is_transformers_greedy_within_the_window(windowed):
    """It was refused at config load (max_position_embeddings=256 passes the window)."""
    from longctx.generate.engine import generate
    from longctx.generate.loading import load_model

    d, hf, _ = windowed
    request = _generate(d, "--prompt", "x = 1", "--max-new-tokens", "4")
    assert request.cfg.model.max_seq_len == W
    ids = request.prompts[0]["ids"]
    new = W - len(ids)
    model = load_model(request.cfg, torch.device("cpu"), torch.float32)
    ours = generate(model, [ids], max_new_tokens=new)[0].tokens
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == theirs and len(ours) == new


def test_generate_past_the_window_is_still_refused_and_an_explicit_length_past_it_too(windowed):
    d = windowed[0]
    with pytest.raises(ConfigError, match=f"the {W}-token sliding window"):
        _generate(d, "--prompt", "x " * 20, "--max-new-tokens", "4")
    with pytest.raises(HFFormatError) as e:
        _generate(d, "--prompt", "x", f"--model.max_seq_len={2 * W}")
    said = " ".join(str(e.value).split())
    assert f"model.max_seq_len={2 * W} passes the model's sliding-window attention (sliding_window={W})" in said
    assert "trains full causal attention" not in said and f"defaults to {W}" in said


def _eval(windowed, *extra, task="ppl"):
    from longctx.eval.request import prepare

    d, _, text = windowed
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{d}", "--task", task, "--data", str(text), "--samples", "2", *extra])
    return args, prepare(args, rest, 1)


def test_eval_without_max_seq_len_is_transformers_nll_within_the_window(windowed):
    from longctx.eval.score_mode import evaluate_score

    args, request = _eval(windowed, "--lengths", str(W), "--buckets", "2")
    assert request.cfg.model.max_seq_len == W
    out = evaluate_score(request, args)
    nll = transformers_nll(windowed[1], request.sequences[W])
    [row] = out["results"]
    assert row["tokens"] == len(nll) == 2 * (W - 1)
    assert row["loss"] == pytest.approx(sum(nll) / len(nll), abs=1e-5)
    with pytest.raises(ConfigError, match=f"past the {W}-token sliding window"):
        _eval(windowed, "--lengths", str(2 * W), "--buckets", "2")


def test_eval_generate_under_infllm_runs_past_the_window(windowed):
    """InfLLM shows no distance past init + window + block - 1 = 13 here: lengths of 128 and 160 are within the
    window for it; eval raised model.max_seq_len to 160 itself and the window's rule refused that."""
    _, request = _eval(windowed, "--lengths", "128,160", "--mode", "generate", "--context-memory", "infllm",
                       "--infllm-block", "4", "--infllm-repr", "2", "--infllm-topk", "2", "--infllm-window", "8",
                       "--infllm-init", "2", "--infllm-positions", "shared", "--samples", "1", task="passkey")
    assert request.cfg.model.max_seq_len == W and request.memory.positions_needed <= W
    assert sorted(request.sequences) == [128, 160]


def test_train_config_without_max_seq_len_is_the_window(windowed):
    """load_config for a run from the weights: max_seq_len is the window; a train.seq_len past it, or a
    max_seq_len given past it, refused naming the window (not "raise model.max_seq_len", which it refuses)."""
    d = windowed[0]
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", f"--train.seq_len={W}"])
    assert cfg.model.max_seq_len == W
    with pytest.raises(HFFormatError, match=f"train.seq_len={2 * W} passes .*sliding_window={W}.*at {W} or less"):
        load_config(overrides=[f"--model.init_from=hf:{d}", f"--train.seq_len={2 * W}"])
    with pytest.raises(HFFormatError, match=f"model.max_seq_len={2 * W} passes"):
        load_config(overrides=[f"--model.init_from=hf:{d}", f"--model.max_seq_len={2 * W}", f"--train.seq_len={W}"])
    assert load_config(overrides=[f"--model.init_from=hf:{d}", "--model.max_seq_len=8",
                                  "--train.seq_len=8"]).model.max_seq_len == 8
