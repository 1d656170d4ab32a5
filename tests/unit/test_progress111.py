"""Long work that went silent in a log (progress audit): each now runs inside a progress phase, whose heartbeat
says it every LONGCTX_PROGRESS_S of quiet (progress.py). Measured before, with stderr to a file on a loaded
2-core machine: `longctx generate` of one 32,000-token prompt on the debug model, 71 s with no line (the prefill;
no tokens are streamed to a file); `longctx train` resuming a small-100m run, 36 s between its resume line and
'checkpoint: resumed' (the model's initialisation and the checkpoint's read); `longctx plan` over 1.88M candidates,
69 s; `longctx plan --validate`, up to 106 s per small-100m case. No timing is asserted: each slow call is replaced
by one that records the phases running while it runs."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import test_hf  # noqa: E402
from test_newcomer import longctx_here  # noqa: E402

import longctx.generate.engine as engine  # noqa: E402
import longctx.train.trainer as trainer_module  # noqa: E402
from longctx import progress  # noqa: E402
from longctx.checkpoint import counted_read  # noqa: E402
from longctx.config import load_config  # noqa: E402


@pytest.fixture(autouse=True)
def _speaking(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "20")  # (lines on; none is written: the calls take far less)
    monkeypatch.delenv("RANK", raising=False)


def _running() -> list[str]:
    """The phases running now, outermost first."""
    with progress._HEARTBEAT.lock:
        return [p.what for p in progress._HEARTBEAT.phases]


def test_generate_runs_its_prompts_inside_a_phase_that_counts_their_new_tokens(tmp_path, monkeypatch):
    hf, _ = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("llama", eos_token_id=0, vocab_size=320))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):", "class A:")))
    seen, real = [], engine.generate

    def recorded(model, rows, **kwargs):
        if kwargs.get("max_new_tokens") == 2:  # (the untimed warm-up: before the prompts' phase)
            return real(model, rows, **kwargs)
        phases = _running()
        results = real(model, rows, **kwargs)
        seen.append((phases, progress.current().done, sum(len(r.tokens) for r in results)))
        return results

    monkeypatch.setattr(engine, "generate", recorded)
    r = longctx_here("generate", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--prompts", str(prompts),
                     "--batch", "1", "--max-new-tokens", "5", "--ignore-eos", "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode == 0, r.stderr
    assert len(seen) == 2, seen  # one call per prompt (--batch 1)
    tokens = sum(json.loads(line)["prompt_tokens"] for line in (tmp_path / "o.jsonl").read_text().splitlines())
    (first, done_1, new_1), (second, done_2, new_2) = seen
    assert first == second == [f"generate: 2 prompts of {tokens} tokens"], seen
    assert (new_1, new_2) == (5, 5) and (done_1, done_2) == (5, 10), seen  # new tokens counted as chosen


BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--train.device=cpu"]


def test_training_set_up_and_a_resumes_read_run_inside_phases(tmp_path, monkeypatch):
    run = [*BASE, f"--train.run_dir={tmp_path / 'r'}"]
    trainer_module.Trainer(load_config(None, [*run, "--train.steps=1"]), log=lambda *a, **k: None).run()
    seen = {}
    real_build, real_load = trainer_module.build_training_model, counted_read.dcp.load

    def build(*args, **kwargs):
        seen["build"] = _running()
        return real_build(*args, **kwargs)

    def load(*args, **kwargs):  # (DCP's read of the resume's states)
        seen["load"] = _running()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_training_model", build)
    monkeypatch.setattr(counted_read.dcp, "load", load)
    trainer = trainer_module.Trainer(load_config(None, [*run, "--train.steps=2", "--checkpoint.resume=auto"]),
                                     log=lambda *a, **k: None)
    assert trainer.start_step == 1
    assert seen["build"] == ["training set-up"], seen
    step = tmp_path / "r" / "checkpoints" / "step-00000001"
    assert seen["load"][0] == "training set-up" and len(seen["load"]) == 2, seen
    assert seen["load"][1].startswith("checkpoint: reading ") and seen["load"][1].endswith(str(step.name)), seen
    assert _running() == []  # (the set-up's phase ended with it)


def test_the_planners_search_runs_inside_a_phase_that_counts_its_mesh_shapes(monkeypatch):
    """`longctx plan --model qwen3-30b-a3b --gpus 4096 --expert 1,2,...,32 --micro-batch 1,2,4 --recompute
    none,full,selective --offload ... --model-states device,host_optimizer,host`: 1.88M candidates, 69 s with
    no line. Each mesh shape's candidates are evaluated (search._tiers) with the shapes before it counted."""
    import longctx.planner.search as search
    from longctx.costs.hardware import PRESETS

    req = search.Request(load_config(None, {"model": {"preset": "llama3-8b"}}).model, PRESETS["h100"], 64, 2**20,
                         gpus_per_node=8)
    shapes = search.candidate_shapes(req)
    seen, real = [], search._tiers

    def tiers(req_, layout, *args, **kwargs):
        p = progress.current()
        seen.append((_running(), p.total, p.unit, p.done, shapes.index(layout.shape)))
        return real(req_, layout, *args, **kwargs)

    monkeypatch.setattr(search, "_tiers", tiers)
    assert search.plan(req).feasible
    assert len(shapes) > 1 and seen
    assert {tuple(s[0]) for s in seen} == {("plan: searching the candidates on 64 GPUs",)}, seen[0]
    assert all(total == len(shapes) and unit == "mesh shapes" and done == at for _, total, unit, done, at in seen)


class _Recorded(Exception):
    """Raised by a stand-in for the spawned job, once it has seen the phases running."""


def test_each_plan_validate_case_runs_inside_a_phase(monkeypatch):
    """`longctx plan --validate`: the case `100m head2xctx2` (small-100m on 4 gloo ranks) ran 73 s with no line
    (a case's row is printed when it ends). The spawned job is replaced by one that records the phases."""
    import longctx.planner.validate as validate

    seen = []

    def spawned(world, *args, **kwargs):
        seen.append((world, _running()))
        raise _Recorded

    monkeypatch.setattr(validate, "run_spawned", spawned)
    case = next(c for c in validate.BYTES_CASES if c.preset == "small-100m")
    with pytest.raises(_Recorded):
        validate.run_case(case, hw=None)
    with pytest.raises(_Recorded):
        validate.run_ranking(validate.RANKING_CASES, hw=None, rounds=2)
    world = validate.RANKING_CASES[0].world
    assert seen == [(case.world, [f"plan --validate: case {case.name} on {case.world} ranks"]),
                    (world, [f"plan --validate: 2 rounds of {len(validate.RANKING_CASES)} ranking cases on {world} "
                             f"ranks"])], seen
    assert _running() == []
