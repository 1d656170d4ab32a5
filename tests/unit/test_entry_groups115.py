"""eval's and generate's in-process entry points end what they started, as train() does: the one-rank process group
memory.model_states = host makes at world 1 (eval's score mode, job/join.py) is ended when the run finishes as when
it fails, so a second run in the process starts as the first did; a group the caller made stays the caller's."""

import json

import pytest
import torch.distributed as dist

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

HOST = "--memory.model_states=host"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("entry_groups115")
    hf = save_hf(build_model(load_config(overrides=["--model.preset=debug", "--model.layers=1"]).model, seed=1),
                 tmp / "hf")
    text = tmp / "filler.py"
    text.write_text("def f(x):\n    return x + 1\n" * 80)
    return hf, text


@pytest.fixture
def made(monkeypatch):
    """The groups the run made itself (job/join.py's one-rank group), as whether one was made each time."""
    import longctx.job.join as join

    calls, make = [], join.init_one_rank_group

    def spy(*args, **kwargs):
        before = dist.is_initialized()
        make(*args, **kwargs)
        calls.append(not before and dist.is_initialized())

    monkeypatch.setattr(join, "init_one_rank_group", spy)
    return calls


@pytest.fixture
def caller_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _eval_args(folder, task="ppl", length=64, *extra):
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--lengths", str(length),
         "--samples", "1", "--data", str(text), HOST, *extra])
    return args, rest


def _score(folder):
    from longctx.eval.request import prepare
    from longctx.eval.score_mode import evaluate_score

    args, rest = _eval_args(folder)
    return evaluate_score(prepare(args, rest, 1), args)


def _tasks(folder):
    """eval's run of several tasks (eval/command.py evaluate_tasks): ppl scored, passkey generated."""
    from longctx.eval.command import evaluate_tasks
    from longctx.eval.request import prepare
    from longctx.eval.task_list import task_args

    args, rest = _eval_args(folder, "ppl,passkey", 160, "--mode", "generate", "--depths", "0.5")
    args_list = task_args(args, ["ppl", "passkey"])
    return evaluate_tasks([prepare(own, rest, 1) for own in args_list], args_list)


def _generate(folder, tmp_path):
    from longctx.generate.cli import prepare, run

    argv = ["generate", "--checkpoint", f"hf:{folder[0]}", "--tokenizer", "byte", "--prompt", "abc",
            "--max-new-tokens", "3", "--output", str(tmp_path / "out.jsonl")]
    args, rest = build_parser("generate").parse_known_args(argv)
    args.argv = argv[1:]
    assert run(prepare(args, rest), args) == 0
    return json.loads((tmp_path / "out.jsonl").read_text())


def test_eval_score_ends_the_group_it_made_and_a_second_run_starts_as_the_first(folder, made):
    assert not dist.is_initialized()
    first = _score(folder)
    assert not dist.is_initialized()
    second = _score(folder)
    assert not dist.is_initialized()
    assert made == [True, True]  # (each run made its own one-rank group)
    assert [r["loss"] for r in first["results"]] == [r["loss"] for r in second["results"]]


def test_eval_of_several_tasks_ends_the_group_it_made(folder, made):
    results = _tasks(folder)
    assert [r["task"] for r in results] == ["ppl", "passkey"]
    assert made == [True] and not dist.is_initialized()


def test_eval_that_fails_ends_the_group_it_made(folder, made, monkeypatch):
    import longctx.eval.runner as runner

    def fail(*args, **kwargs):
        raise RuntimeError("stopped in the first length")

    monkeypatch.setattr(runner, "score", fail)
    with pytest.raises(RuntimeError, match="stopped in the first length"):
        _score(folder)
    assert made == [True] and not dist.is_initialized()


def test_a_group_the_caller_made_stays_the_callers(folder, made, caller_group, tmp_path):
    _score(folder)
    _tasks(folder)
    _generate(folder, tmp_path)
    assert made == [False, False]  # (the caller's group used: none made)
    assert dist.is_initialized() and dist.group.WORLD is caller_group


def test_generate_leaves_the_process_as_it_found_it(folder, tmp_path):
    first = _generate(folder, tmp_path)
    assert not dist.is_initialized()
    assert _generate(folder, tmp_path)["tokens"] == first["tokens"]
    assert not dist.is_initialized()
