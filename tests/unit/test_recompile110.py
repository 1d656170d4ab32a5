"""train.compile's recompiles made visible, and the compiler checked before any work.

A compiled block part that compiles again every step (DTS-Gate's router did: its step, a Python int, was a guarded
constant; commit 7a0a500) reached torch._dynamo's recompile limit and ran eagerly for the rest of the run, said
only by one warning of torch's logging. Now each recompile after the warm-up is a line of the run naming the part
and the guard that failed, counted in the metrics line's `compile_recompiles`; the limit hit is a WARNING line and
`compile_limit_hits` on every later line (train/recompile_hook.py). A normal compiled run (the first step's graphs,
the first evaluation's no-grad ones) shows none. `longctx generate --compile` counts the compiles after its
warm-up in each output line. No C++ compiler is refused by `longctx train`'s preflight, before the data."""

import functools
import json

import pytest
import torch

import longctx.train.preflight as preflight_module
import longctx.train.trainer as trainer_module
from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.models.llama import Block
from longctx.train.hooks import StepHook
from longctx.train.trainer import Trainer


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # (earlier tests' compiles neither count nor use up the limit)
    yield
    torch._dynamo.reset()


def _cfg(tmp_path, *extra):
    return load_config(None, ["--model.layers=1", "--train.seq_len=64", "--train.global_batch=2",
                              "--data.max_docs=20", "--metrics.plots=false", "--metrics.progress=false",
                              "--train.device=cpu", "--checkpoint.final=false", "--metrics.log_interval=1",
                              "--train.compile=true", f"--train.run_dir={tmp_path / 'run'}", *extra])


def _train(cfg, first_hooks=lambda trainer: []):
    """(the run's log lines, its train metrics records by step); `first_hooks(trainer)`: step hooks run first."""
    lines = []
    trainer = Trainer(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    trainer.hooks.hooks[:0] = first_hooks(trainer)
    trainer.run()
    records = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return lines, {r["step"]: r for r in records if r["kind"] == "train"}


class _Tick(StepHook):
    """Sets each block's `tick`, a Python int, to the step before it runs: what DTS-Gate's router step was."""

    def __init__(self, model):
        self.model = model

    def step_start(self, step: int) -> None:
        for layer in self.model.layers:
            layer.tick = step


def test_a_part_recompiling_every_step_is_said_counted_and_its_limit_hit_a_warning(tmp_path, monkeypatch):
    plain_post = Block.post

    def post_reading_the_step(self, x, attn):  # (x 1: the same numbers; the int is a guarded constant)
        return plain_post(self, x, attn) * (1 + 0 * getattr(self, "tick", 0))

    monkeypatch.setattr(Block, "post", post_reading_the_step)
    # dynamo's guards and limit are the backend's whatever it is: aot_eager spares inductor's ~3 s per graph
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    cfg = _cfg(tmp_path, "--train.steps=5", "--train.eval_interval=0")
    with torch._dynamo.config.patch(recompile_limit=3):  # (8 by default: the same, in more steps)
        trainer_lines, train = _train(cfg, lambda trainer: [_Tick(trainer.model)])
    # step 1: the first graph (warm-up); steps 2, 3: one recompile each; step 4: the limit (3 graphs) refuses the
    # fourth, and `post` runs eagerly from then on (no compile at step 5), said on every line after
    assert [train[s]["compile_recompiles"] for s in range(1, 6)] == [0, 1, 1, 0, 0]
    assert [train[s].get("compile_limit_hits", 0) for s in range(1, 6)] == [0, 0, 0, 1, 1]
    said = [x for x in trainer_lines if x.startswith("train.compile:")]
    assert len(said) == 3, said
    assert "`post_reading_the_step`" in said[0] and "compiled again at step 2" in said[0]
    assert "tick" in said[0]  # dynamo's guard that failed, in its words
    assert "recompile limit (3 compiles)" in said[0] and "compiled again at step 3, its recompile 2" in said[1]
    assert "tick" in said[1] and "recompile limit" not in said[1]  # (the first line explains, once)
    hit = said[2]
    assert "WARNING" in hit and "`post_reading_the_step`" in hit and "at step 4" in hit and "EAGERLY" in hit
    assert "tick" in hit and "--train.compile=false" in hit
    step4 = next(x for x in trainer_lines if x.startswith("step     4 |"))
    assert "EAGER: 1 compiled region(s) past the recompile limit" in step4


def test_a_normal_compiled_run_recompiles_nothing_after_its_first_step(tmp_path):
    """The debug model compiled, with evaluations (their no-grad graphs compile in the first one: warm-up too)."""
    lines, train = _train(_cfg(tmp_path, "--train.steps=4", "--train.eval_interval=2"))
    assert [r["compile_recompiles"] for r in train.values()] == [0, 0, 0, 0]
    assert not any("compile_limit_hits" in r for r in train.values())
    assert not [x for x in lines if x.startswith("train.compile:")]


@pytest.fixture
def no_cpp_compiler():
    """inductor's C++ compiler search pointed at a compiler that does not exist (its search is cached: cleared)."""
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    cpp_compiler_search.cache_clear()
    with config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        yield
    cpp_compiler_search.cache_clear()


def test_no_cpp_compiler_is_refused_by_the_preflight_before_the_data(tmp_path, monkeypatch, no_cpp_compiler):
    def no_data_yet(*_a, **_k):
        raise AssertionError("the data was checked (built) before the compiler")

    monkeypatch.setattr(preflight_module, "_check_data", no_data_yet)
    with pytest.raises(ConfigError, match=r"train\.compile.*C\+\+ compiler.*--train\.compile=false"):
        preflight_module.preflight(_cfg(tmp_path, "--train.steps=1"), 1, log=lambda *a: None)


def test_no_cpp_compiler_is_refused_by_a_rank_before_its_model(tmp_path, monkeypatch, no_cpp_compiler):
    """A rank started without the launcher's preflight (torchrun, a Python caller) checks too, before building."""
    def no_model_yet(*_a, **_k):
        raise AssertionError("the model was built before the compiler was checked")

    monkeypatch.setattr(trainer_module, "build_training_model", no_model_yet)
    with pytest.raises(ConfigError, match=r"train\.compile.*C\+\+ compiler.*--train\.compile=false"):
        Trainer(_cfg(tmp_path, "--train.steps=1", "--train.eval_interval=0"), log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    pytest.importorskip("transformers")
    test_hf, _, bpe_tokenizer = _e2e_helpers()
    target, _ = test_hf.random_hf_dir(tmp_path_factory.mktemp("hf"), test_hf.hf_config("llama", eos_token_id=0),
                                      name="target")
    bpe_tokenizer(target / "tokenizer.json")
    return target


def _e2e_helpers():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    import test_hf
    from test_newcomer import longctx_here
    from test_tokenizer_follows_model import bpe_tokenizer

    return test_hf, longctx_here, bpe_tokenizer


def _generate_compiled(target, tmp_path, monkeypatch, warm_one_row: bool):
    """`longctx generate --compile` of 3 prompts at --batch 2 (dynamo's counting backend: no inductor), its output
    lines and stderr. `warm_one_row`: the warm-up compiles the 1-row graphs only (as it once did), so the first
    batch of 2 rows compiles again inside its timed generation."""
    from torch._dynamo.testing import CompileCounter

    import longctx.generate.cli as cli
    import longctx.models.static_decode as static_decode

    class Counted(static_decode.CompiledStep):
        def __init__(self, mode=None, backend="inductor"):
            super().__init__(mode, backend=CompileCounter())

    monkeypatch.setattr(static_decode, "CompiledStep", Counted)
    if warm_one_row:
        real = cli._warm_up

        def one_row_warm_up(request, args, *rest, **kw):
            batch, args.batch = args.batch, 1
            try:
                return real(request, args, *rest, **kw)
            finally:
                args.batch = batch

        monkeypatch.setattr(cli, "_warm_up", one_row_warm_up)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):", "class A:", "import os")))
    r = _e2e_helpers()[1]("generate", "--checkpoint", f"hf:{target}", "--prompts", str(prompts), "--batch", "2",
                          "--max-new-tokens", "6", "--ignore-eos", "--compile", "--output", str(out))
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in out.read_text().splitlines()], r.stderr


def test_generate_compile_counts_and_says_a_compile_after_its_warm_up(hf_target, tmp_path, monkeypatch):
    lines, stderr = _generate_compiled(hf_target, tmp_path, monkeypatch, warm_one_row=True)
    first, second = lines[0]["compile_recompiles"], lines[2]["compile_recompiles"]
    assert first >= 1 and lines[1]["compile_recompiles"] == first and second == 0, lines
    said = [x for x in stderr.splitlines() if x.startswith("generate: --compile:") and "compiled again" in x]
    assert len(said) == first and "for the batch from prompt 1" in said[0] and "the guard that failed" in said[0]


def test_generate_compile_normally_compiles_nothing_after_its_warm_up(hf_target, tmp_path, monkeypatch):
    lines, stderr = _generate_compiled(hf_target, tmp_path, monkeypatch, warm_one_row=False)
    assert [x["compile_recompiles"] for x in lines] == [0, 0, 0]
    assert "compiled again" not in stderr
