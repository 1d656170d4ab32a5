"""A sliding-window model (Mistral's sliding_window) in `longctx eval --mode score`, `longctx generate`'s
messages, and `longctx bench decode` past a model's reach (helper audit after test_swa_window_audit.py).

longctx has no sliding-window attention: teacher-forced over 64 tokens of a random Mistral with a 16-token
window, its per-token NLL equals transformers' (eager, the window applied) to 1e-6 at positions 0-15 and is
off by 0.15-2.8 (mean 0.86) from position 16 on. So:
- eval --mode score within the window must be transformers' figure; it never ran: the model build read the
  weights' config.json at its max_position_embeddings (train/model.py init_from_changes), which the window
  refuses, after the launch and the weights' load, whatever --model.max_seq_len said (`longctx train` too).
- past the window, score mode is refused before work, naming the window and the --lengths that fit (it was
  refused by the config's rule, which names model.max_seq_len, a value eval sets from --lengths).
- generate's refusal of a prompt past a window told the user to pass --allow-extrapolation, which the
  window check then refuses; its note on new tokens cut at the window offered RoPE scaling, which moves no
  window. Both now say the ways out that work.
- bench decode past the positions a (non-windowed) target reaches ran with no note; eval's note now."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.cli import build_parser  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402

W = 16


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return windowed_model(tmp_path_factory.mktemp("swa_eval"))


def windowed_model(tmp):
    """(the directory of a random Mistral with a W-token window and its tokenizer, transformers' model of it
    with the window applied (eager), a text to evaluate on), under `tmp`."""
    d, hf = test_hf.random_hf_dir(tmp, test_hf.hf_config("mistral", sliding_window=W))
    hf.config._attn_implementation = "eager"
    bpe_tokenizer(d / "tokenizer.json")
    text = tmp / "text.py"
    text.write_text("def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 30)
    return d, hf, text


def _eval_args(windowed, *extra, task="ppl"):
    d, _, text = windowed
    return build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{d}", "--task", task, "--data", str(text), "--samples", "2",
         *(["--buckets", "2"] if task == "ppl" else []), f"--model.max_seq_len={W}", *extra])


def test_score_within_the_window_is_transformers_nll(windowed):
    """It ran to the model build and stopped there (the window's refusal of max_position_embeddings 256)."""
    from longctx.eval.request import prepare
    from longctx.eval.score_mode import evaluate_score

    args, rest = _eval_args(windowed, "--lengths", str(W))
    request = prepare(args, rest, 1)
    out = evaluate_score(request, args)
    nll = transformers_nll(windowed[1], request.sequences[W])
    [row] = out["results"]
    assert row["tokens"] == len(nll) == 2 * (W - 1)
    assert row["loss"] == pytest.approx(sum(nll) / len(nll), abs=1e-5)


def transformers_nll(model, sequences) -> list[float]:
    """Each next-token NLL of `sequences` (eval's) under the transformers `model`, in float64: the
    reference eval's score mode is compared with (the last position predicts nothing)."""
    nll = []
    for seq in sequences:
        tokens = torch.as_tensor(np.asarray(seq.tokens), dtype=torch.long)
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens[None]).logits[0].double(), -1)
        nll += (-logp[:-1].gather(1, tokens[1:, None])[:, 0]).tolist()
    return nll


def test_init_from_changes_reads_windowed_weights_at_their_window(windowed):
    from longctx.train.model import init_from_changes

    d = windowed[0]
    for n, changed in ((W, []), (8, [f"model.max_seq_len: {W} -> 8"])):
        cfg = load_config(overrides=[f"--model.init_from=hf:{d}", f"--model.max_seq_len={n}", f"--train.seq_len={n}"])
        assert init_from_changes(cfg) == changed


@pytest.mark.parametrize("task", ["ppl", "passkey"])
def test_score_past_the_window_is_refused_naming_the_lengths_that_fit(windowed, task):
    from longctx.eval.request import prepare

    args, rest = _eval_args(windowed, "--lengths", f"{W},{2 * W}", task=task)
    with pytest.raises(ConfigError) as e:
        prepare(args, rest, 1)
    said = " ".join(str(e.value).split())
    assert said.startswith(f"--lengths {2 * W}: past the {W}-token sliding window"), said
    assert f"the {task} figures would not be this model's" in said and "does not apply to --mode score" in said
    assert f"--lengths up to {W} (here {W})" in said and f"set sliding_window null in {windowed[0]}" in said


def _generate(windowed, prompt: str, new: int):
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(
        ["generate", "--checkpoint", f"hf:{windowed[0]}", "--prompt", prompt, "--max-new-tokens", str(new),
         f"--model.max_seq_len={W}"])
    return prepare(args, rest)


def test_generate_past_the_window_says_the_ways_out_that_work(windowed):
    """The advice was --allow-extrapolation (then refused: test_swa_window_audit.py) and, for new tokens cut at
    the window, RoPE scaling too (which moves no window)."""
    with pytest.raises(ConfigError) as e:
        _generate(windowed, "x " * 20, 4)
    said = " ".join(str(e.value).split())
    assert f"past the {W} positions the model reaches" in said and f"the {W}-token sliding window" in said
    assert "--allow-extrapolation" not in said and "RoPE" not in said
    assert "--context-memory infllm" in said and f"set sliding_window null in {windowed[0]}" in said
    request = _generate(windowed, "x " * 5, 30)
    [note] = [n for n in request.notes if "leave room" in n]
    assert request.limits[0] == W - len(request.prompts[0]["ids"]) and f"within the {W:,} positions" in note
    assert "--allow-extrapolation" not in note and "RoPE" not in note and "--context-memory infllm" in note


def test_bench_decode_past_the_targets_reach_says_so(tmp_path, capsys):
    """A Llama trained on 256 positions (not windowed): prompts + new tokens past them are said once, as eval
    says it, without eval's --model.* scaling (bench decode takes no such flag)."""
    from longctx.bench.decode import _prompts
    from longctx.data.tokenizer import ByteTokenizer

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(test_hf.hf_config("llama", max_position_embeddings=256)))
    m = load_config(None, {"model": {"init_from": f"hf:{d}"}, "train": {"seq_len": 2, "eval_interval": 0}}).model
    (tmp_path / "a.py").write_text("".join(chr(97 + j % 26) for j in range(600)))
    args = SimpleNamespace(prompts="", data=str(tmp_path / "a.py"), lengths="64,200,512", samples=1, target=f"hf:{d}",
                           max_new_tokens=64)
    assert sorted(_prompts(args, ByteTokenizer(), "byte", m)) == [64, 200, 512]
    err = " ".join(capsys.readouterr().err.split())
    assert ("note: lengths 200, 512 (+ 64 new tokens) run past the 256 positions the model reaches (trained on 256: "
            "its config.json's max_position_embeddings): their figures measure extrapolation") in err, err
    assert "--model." not in err
    args.lengths = "64,192"
    args.max_new_tokens = 64
    _prompts(args, ByteTokenizer(), "byte", m)
    assert "run past" not in capsys.readouterr().err  # (192 + 64 = 256: within)
