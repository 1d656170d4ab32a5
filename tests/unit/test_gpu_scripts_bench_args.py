"""The `longctx bench` commands of the GPU session scripts pass bench's own checks (on a machine with
CUDA): a lent GPU's minutes are few, and a step refused for its flags (gpu_speed.sh's MoE step at --top-k 8
with the default --skew-share 0.5, which one expert cannot take) loses its figures with nothing to rerun."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("gpu_speed.sh", "gpu_session.sh", "gpu_issue47.sh", "gpu_decode.sh")


def _bench_commands(script: Path) -> list[list[str]]:
    """Each `python3 -m longctx bench ...` of a script, its continued lines joined, up to its redirect."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    text = re.sub(r'"?\$\{\w+\[@\]\}"?', "", text)  # (a bash array of extra flags: the command without them)
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r"-m longctx bench (.*?)(?:\s*(?:[0-9]?>|\||;|&&|$))", line):
            argv = [re.sub(r"\$\{?\w+\}?", "x", a) for a in shlex.split(m.group(1))]  # ($OUT/moe.json: x/moe.json)
            out.append(argv)
    return out


@pytest.mark.parametrize("name", SCRIPTS)
def test_gpu_scripts_bench_commands_pass_the_checks(name, monkeypatch):
    import torch

    from longctx.bench.arg_checks import check_bench_args
    from longctx.cli import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for argv in _bench_commands(ROOT / "benchmarks" / name):
        args, rest = build_parser("bench").parse_known_args(["bench", *argv])
        assert not rest, (name, argv, rest)
        check_bench_args(argv[0], args)


def test_gpu_speed_runs_bench_moe_and_generate():
    found = {argv[0] for argv in _bench_commands(ROOT / "benchmarks" / "gpu_speed.sh")}
    assert found == {"moe", "generate"}
