"""`longctx generate --checkpoint RUN/checkpoints` reads the step `latest` names, or, when that one is missing or
incomplete, the newest complete step: quietly, and its describe line never said which step it read. It says the
step now (eval's loading line too), and in that case that `latest` named a missing one. And a bad --checkpoint
was refused in the words of `model.init_from = ...`, a key the user of generate and eval never wrote: the flag
typed is named (bench decode's --target likewise)."""

import json
from pathlib import Path

import pytest
import torch

from longctx.checkpoint.manifest import write_manifest
from longctx.cli import build_parser
from longctx.config import load_config
from longctx.config.load import to_dict
from longctx.errors import ConfigError


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """A checkpoints directory of steps 1 and 3 (manifests only: nothing here reads the weights)."""
    root = tmp_path_factory.mktemp("said") / "run" / "checkpoints"
    model = to_dict(load_config(overrides=["--model.layers=1"]))["model"]
    for step in (1, 3):
        (root / f"step-{step:08d}").mkdir(parents=True)
        write_manifest(root / f"step-{step:08d}", step=step, layout={}, model=model, tokenizer="byte")
    return root


def _args(command, *argv):
    return build_parser(command).parse_known_args([command, *map(str, argv)])


def _describe(checkpoint) -> str:
    from longctx.generate.cli import _describe, prepare

    args, rest = _args("generate", "--checkpoint", checkpoint, "--prompt", "ab cd", "--max-new-tokens", "2")
    return _describe(prepare(args, rest), args, torch.device("cpu"), torch.float32)


def test_the_describe_line_says_the_step_read(checkpoints):
    (checkpoints / "latest").write_text("step-00000003")
    assert f"), {checkpoints} step 3, on cpu" in _describe(checkpoints)
    assert f"), {checkpoints / 'step-00000001'} step 1, on cpu" in _describe(checkpoints / "step-00000001")


@pytest.mark.parametrize("latest", ["step-00000009", "step-00000002"])
def test_a_latest_naming_a_missing_step_is_said_beside_the_step_read(checkpoints, latest):
    (checkpoints / "step-00000002").mkdir(exist_ok=True)  # (a step whose save did not finish: no manifest)
    (checkpoints / "latest").write_text(latest)
    said = _describe(checkpoints)
    assert (f"), {checkpoints} step 3 (the newest complete one: its `latest` names {latest}, which is missing or "
            f"incomplete), on cpu") in said, said


@pytest.mark.parametrize("command, extra", [("generate", ["--prompt", "x"]),
                                            ("eval", ["--task", "ppl", "--lengths", "64"])])
def test_a_bad_checkpoint_is_refused_naming_the_flag(checkpoints, tmp_path, command, extra):
    if command == "generate":
        from longctx.generate.cli import prepare
    else:
        from longctx.eval.request import prepare as prepare_eval

        prepare = lambda args, rest: prepare_eval(args, rest, 1)  # noqa: E731
    run = checkpoints.parent
    damaged = tmp_path / "step-00000004"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{not json")
    listless = tmp_path / "listless" / "step-00000001"
    listless.mkdir(parents=True)
    (listless / "manifest.json").write_text(json.dumps({"step": 1}))
    for given, said in [(tmp_path / "nowhere", f"--checkpoint {tmp_path / 'nowhere'} holds no complete longctx "
                                               f"checkpoint"),
                        (run, f"--checkpoint {run} holds no complete longctx checkpoint .*\\({checkpoints} holds some: "
                              f"pass --checkpoint {checkpoints}\\)"),
                        (f"hf:{tmp_path / 'nowhere'}",
                         f"--checkpoint hf:{tmp_path / 'nowhere'}: .* is not a directory"),
                        (damaged, f"--checkpoint {damaged}: .*manifest.json cannot be read"),
                        (listless, f"--checkpoint {listless}: .*manifest.json records no \\[model\\]")]:
        with pytest.raises(ConfigError, match=said) as e:
            prepare(*_args(command, "--checkpoint", given, *extra))
        assert "model.init_from" not in str(e.value)


def test_bench_decode_names_its_target_flag(tmp_path):
    from longctx.bench.decode import _models

    args, _ = _args("bench", "decode", "--target", tmp_path / "nowhere", "--draft", tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=f"--target {tmp_path / 'nowhere'} holds no complete longctx checkpoint"):
        _models(args)
