"""`longctx generate --compile` compiles its graphs in the untimed warm-up, not inside the first timed
generation (generate/cli.py _warm_up: "so the first prompt's rates do not include the kernels' first-call
setup"). The warm-up was one prompt at batch 1, plain: a run of several prompts per --batch (rows 2, say)
compiled again for that batch inside its first timed generation, and under --draft the target's
verification buckets and the draft's own steps were first compiled inside the first prompt's timing
(inductor on a CPU: seconds to tens of seconds in a decode_tokens_per_s of milliseconds per token).
The compilations are counted with dynamo's counting backend; each test records how many there were
when the first timed generation began and asserts none came after."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import test_hf  # noqa: E402
from test_newcomer import longctx_here  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

import longctx.generate.engine as engine  # noqa: E402
import longctx.generate.speculative as speculative  # noqa: E402
import longctx.models.static_decode as static_decode  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    target, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", eos_token_id=0), name="target")
    bpe_tokenizer(target / "tokenizer.json")
    draft, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", eos_token_id=0, num_hidden_layers=1),
                                     name="draft")
    (draft / "tokenizer.json").write_text((target / "tokenizer.json").read_text())
    return target, draft


def _counted(monkeypatch, timed_entry):
    """Every CompiledStep the command makes counts its compilations; `timed_entry` (module, name): the
    function whose first call starts the timed generations. Returns (counter, frames when it began)."""
    counter, at_start = CompileCounter(), []

    class Counted(static_decode.CompiledStep):
        def __init__(self, mode=None, backend="inductor"):
            super().__init__(mode, backend=counter)

    monkeypatch.setattr(static_decode, "CompiledStep", Counted)
    module, name = timed_entry
    real = getattr(module, name)

    def timed(*args, **kwargs):
        if kwargs.get("max_new_tokens", 0) != 2 or at_start:  # (the plain warm-up asks 2 tokens of one prompt)
            at_start.append(counter.frame_count)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, timed)
    return counter, at_start


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.8", "--top-k", "20"], ["--logprobs", "2"]],
                         ids=["greedy", "sampled", "logprobs"])
def test_several_prompts_per_batch_compile_nothing_after_the_warm_up(dirs, tmp_path, monkeypatch, extra):
    """Plain decoding's compiled step chooses the token in its graph (generate/blocks.py): a graph per
    choice (greedy, sampling's settings) and per logprobs kept, all compiled by the warm-up."""
    target, _ = dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):", "class A:", "import os")))
    counter, at_start = _counted(monkeypatch, (engine, "generate"))
    r = longctx_here("generate", "--checkpoint", f"hf:{target}", "--prompts", str(prompts), "--batch", "2",
                     "--max-new-tokens", "6", "--ignore-eos", "--compile", *extra,
                     "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode == 0, r.stderr
    assert at_start and counter.frame_count >= 1
    assert counter.frame_count == at_start[0], (at_start, counter.frame_count)  # none inside a timed generation


@pytest.mark.parametrize("extra", [[], ["--cape"], ["--speculate-adaptive"]], ids=["chain", "cape", "adaptive"])
def test_speculation_compiles_nothing_after_the_warm_up(dirs, tmp_path, monkeypatch, extra):
    """The chain's and CaPE's verification buckets and the draft's steps; adaptive speculation's plain steps
    leave their tokens for the draft's next call (ModelDrafter.skipped), so its draft calls take any bucket."""
    target, draft = dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):", "class A:\n  x = 1\n" * 3)))
    counter, at_start = _counted(monkeypatch, (speculative, "speculate_one"))
    r = longctx_here("generate", "--checkpoint", f"hf:{target}", "--draft", f"hf:{draft}", "--speculate", "3",
                     "--prompts", str(prompts), "--max-new-tokens", "40", "--ignore-eos", "--compile", *extra,
                     "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode == 0, r.stderr
    assert len(at_start) == 2 and counter.frame_count >= 1
    assert counter.frame_count == at_start[0], (at_start, counter.frame_count)


def test_bench_decode_compiles_adaptive_drafts_before_its_timings(monkeypatch):
    """`bench decode --compile --speculate-adaptive`: its untimed warm-up (bench/decode.py _compiled_step)
    compiled the draft's steps of one or two tokens only; adaptive plain steps feed it more at once."""
    from types import SimpleNamespace

    from longctx.bench.decode import _compiled_step
    from longctx.config import load_config
    from longctx.generate.drafters import ModelDrafter
    from longctx.generate.spec_length import AdaptiveLength, draft_cost_ratio
    from longctx.models.llama import build_model

    counter = CompileCounter()

    class Counted(static_decode.CompiledStep):
        def __init__(self, mode=None, backend="inductor"):
            super().__init__(mode, backend=counter)

    monkeypatch.setattr(static_decode, "CompiledStep", Counted)
    target = build_model(load_config(overrides=["--model.layers=2"]).model, seed=1).eval()
    draft = build_model(load_config(overrides=["--model.layers=1"]).model, seed=2).eval()  # (a poor draft)
    step = _compiled_step(SimpleNamespace(speculate=3, speculate_adaptive="true"), target, draft, None)
    warmed = counter.frame_count
    prompt = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    policy = AdaptiveLength(3, draft_cost_ratio(target, draft))
    speculative.speculative_generate(target, ModelDrafter(draft, 24 + 40 + 8, compile=step), prompt,
                                     max_new_tokens=40, k=3, adaptive=policy, compile=step)
    assert 0 in policy.chosen  # plain steps were taken (their tokens fed to the draft later, several at once)
    assert counter.frame_count == warmed, (warmed, counter.frame_count)
