"""A sliding-window model (Mistral-7B-v0.1's sliding_window 4,096; Qwen's use_sliding_window) past its window:
longctx has no sliding-window attention, so there it attends to every earlier position where transformers (and
the model's own training) attend to the last W only. `longctx generate` capped its prompts at the window, but
the library it wraps (generate/engine.py generate, the decode loop every entry point shares) decoded past it
with full attention, the logits O(1) off transformers' and no error. Now every entry point refuses, in the
decode loop (generate/loading.py check_window) and, before any weight is read, in the commands."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.config import load_config  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402

W = 16
PROMPT = [5, 17, 42, 99, 3, 250]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A random Mistral with a 16-token window (transformers' own weights, its attention eager so that the
    window is applied: the reference), and longctx's model of the same directory."""
    from longctx.generate.loading import load_model

    d, hf = test_hf.random_hf_dir(tmp_path_factory.mktemp("swa"), test_hf.hf_config("mistral", sliding_window=W))
    hf.config._attn_implementation = "eager"
    bpe_tokenizer(d / "tokenizer.json")
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", f"--model.max_seq_len={W}", f"--train.seq_len={W}"])
    return d, hf, cfg, load_model(cfg, torch.device("cpu"), torch.float32)


def test_transformers_windows_where_longctx_attends_fully(windowed):
    """Why a refusal: teacher-forced, the two agree up to the window and part by O(1) right after it (the
    query at position W is the first whose window leaves a key out)."""
    _, hf, _, model = windowed
    seq = torch.randint(0, 300, (1, 2 * W), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (hf(seq).logits[0] - model(seq)[0]).abs().amax(-1)
    assert gap[:W].max() < 1e-4 and gap[W] > 1e-2, gap


def test_library_generate_past_the_window_is_refused(windowed):
    """It ran: 10 + 30 tokens, full attention from position 16 on (its new tokens parted from transformers'
    greedy ones at the 8th, position 17, the logits by up to 3.4)."""
    from longctx.generate.engine import generate

    model = windowed[3]
    with pytest.raises(ConfigError, match=r"40 positions, past the 16-token sliding window.*sliding_window null"):
        generate(model, [PROMPT + [7, 8, 120, 33]], max_new_tokens=30)
    with pytest.raises(ConfigError, match="17 positions"):  # (one past: the window is the bound)
        generate(model, [[1] * 9, PROMPT], max_new_tokens=[8, 4])


def test_within_the_window_tokens_are_transformers_greedy(windowed):
    from longctx.generate.engine import generate

    _, hf, _, model = windowed
    ours = generate(model, [PROMPT], max_new_tokens=W - len(PROMPT))[0].tokens
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=W - len(PROMPT), min_new_tokens=W - len(PROMPT),
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == theirs and len(ours) == W - len(PROMPT)


def test_infllm_memory_within_the_window_still_runs_past_it(windowed):
    """InfLLM's context memory shows no distance past init + window + block - 1 whatever the length: that span,
    not the prompt, meets the window (as `longctx generate --context-memory infllm` checks it)."""
    from longctx.generate.context_memory import InfLLMGeneration
    from longctx.generate.engine import generate
    from longctx.models.context_memory import InfLLMShape

    model = windowed[3]
    backend = InfLLMGeneration(InfLLMShape(block=4, repr=2, topk=2, window=8, init=2))  # far 13: 14 positions
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert len(generate(model, [prompt], max_new_tokens=6, backend=backend)[0].tokens) == 6
    with pytest.raises(ConfigError, match="20 positions"):  # (far 19: past the window)
        generate(model, [prompt], max_new_tokens=6, backend=InfLLMGeneration(InfLLMShape(4, 2, 2, 12, 4)))


def test_cli_with_allow_extrapolation_is_refused_before_loading(windowed):
    """--allow-extrapolation lets a prompt run past the positions a model reaches; a window is no such reach
    (past it the tokens are not the model's at all): refused before any weight is read."""
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    d = windowed[0]
    args, rest = build_parser("generate").parse_known_args(
        ["generate", "--checkpoint", f"hf:{d}", "--prompt", "x " * 10, "--max-new-tokens", "20",
         "--allow-extrapolation", f"--model.max_seq_len={W}"])
    with pytest.raises(ConfigError, match="past the 16-token sliding window"):
        prepare(args, rest)


def test_eval_generate_mode_is_refused_before_loading(windowed):
    """eval --mode generate's prompts run to the length and EXTRA_NEW_TOKENS past it."""
    from types import SimpleNamespace

    from longctx.eval.generate_mode import EXTRA_NEW_TOKENS, _check_window

    cfg = windowed[2]
    _check_window(SimpleNamespace(cfg=cfg, lengths=[4, W - EXTRA_NEW_TOKENS - 1], memory=None), 1)
    with pytest.raises(ConfigError, match=f"--lengths up to {W - EXTRA_NEW_TOKENS - 1} fit"):
        _check_window(SimpleNamespace(cfg=cfg, lengths=[4, W], memory=None), 1)


def test_a_qwen_windowed_by_use_sliding_window_is_refused_too(tmp_path):
    """Qwen2's window applies with use_sliding_window (here to every layer: max_window_layers 0)."""
    from longctx.generate.engine import generate
    from longctx.models.llama import build_model

    config = test_hf.hf_config("qwen2", sliding_window=W, use_sliding_window=True, max_window_layers=0)
    d = tmp_path / "qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", f"--model.max_seq_len={W}", f"--train.seq_len={W}"])
    model = build_model(cfg.model)  # (random weights: the window is the config's, not the weights')
    with pytest.raises(ConfigError, match="use_sliding_window false"):
        generate(model, [PROMPT], max_new_tokens=W)


def test_bench_decode_is_refused_before_loading(windowed, tmp_path):
    """`longctx bench decode`'s prompts and --max-new-tokens, checked with its target's config."""
    from types import SimpleNamespace

    from longctx.bench.decode import _prompts
    from longctx.data.tokenizer import load_tokenizer

    d, _, cfg, _ = windowed
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x " * 6}) + "\n")
    tok = load_tokenizer(str(d / "tokenizer.json"))
    args = SimpleNamespace(prompts=str(tmp_path / "p.jsonl"), target=f"hf:{d}", max_new_tokens=4)
    n = len(_prompts(args, tok, str(d / "tokenizer.json"), cfg.model)["prompts"][0])
    args.max_new_tokens = W + 1 - n
    with pytest.raises(ConfigError, match=f"bench decode: .* {W + 1} positions"):
        _prompts(args, tok, str(d / "tokenizer.json"), cfg.model)
