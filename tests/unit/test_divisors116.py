"""Values a message lists the divisors of (kv heads, parallel degrees, experts) are mistyped counts as often as
real ones: `--model.heads 1099511627777` against kv_heads 2 hung the config check, which listed the choices by a
loop to the value itself, before its error was ever said. Listing takes the square root's steps now, and a count
too large to list is named instead."""

import signal

import pytest

from longctx.config.divisors import LISTED_UP_TO, among, divisors
from longctx.config.load import load_config
from longctx.config.rules import validate, working_layouts
from longctx.errors import ConfigError


def test_the_divisors_are_every_divisor_in_order():
    for n in [*range(1, 400), 720720, 999_983 * 2, 2**38, LISTED_UP_TO]:
        brute = [d for d in range(1, n + 1) if n % d == 0] if n < 10**6 else None
        found = divisors(n)
        assert found == sorted(set(found)) and all(n % d == 0 for d in found)
        if brute is not None:
            assert found == brute
        else:  # (no brute force this far: every pair d, n // d of the square-root search is there)
            assert len(found) == len({d for d in found} | {n // d for d in found})
    assert divisors(LISTED_UP_TO + 1) is None and among(LISTED_UP_TO + 1) == f"the divisors of {LISTED_UP_TO + 1}"
    assert working_layouts(8, 2, 8) == [f"--parallel.head {h} --parallel.ctx {8 // h}" for h in (1, 2, 4, 8)]


def _alarm(signum, frame):
    raise TimeoutError("the config check ran past 20 s")


@pytest.mark.parametrize("overrides, key", [
    ({"model": {"heads": 1099511627777, "kv_heads": 2}}, "model.kv_heads"),
    ({"model": {"heads": 2**62 + 1, "kv_heads": 2}}, "model.kv_heads"),
    ({"parallel": {"ctx": 2**40 + 1, "window": 2}}, "parallel.window"),
    ({"parallel": {"head": 2**40 + 1, "ctx": 1, "dp_shard": 1}}, "parallel.head"),
    ({"model": {"preset": "debug-moe", "moe.experts": 2**61 + 1}, "parallel": {"expert": 2}}, "parallel.expert"),
])
def test_a_huge_count_is_refused_at_once(tmp_path, overrides, key):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        with pytest.raises(ConfigError) as refused:
            validate(load_config(None, overrides))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert key in str(refused.value)


@pytest.mark.parametrize("value", [2**63, 2**64 + 5, -(2**63) - 1])
def test_a_count_past_a_toml_integer_is_refused_naming_the_key(value):
    """A config.toml records the run's every value; one past TOML's signed 64-bit integers was taken and written
    where other TOML readers refuse the file (Python's reads it back, so nothing said it)."""
    with pytest.raises(ConfigError, match=r"train\.steps = .* past a TOML integer's range"):
        load_config(None, {"train": {"steps": value}})
    assert load_config(None, {"train": {"seed": 2**63 - 1}}).train.seed == 2**63 - 1


def test_the_planner_refuses_a_gpu_count_past_what_its_mesh_search_lists():
    """`longctx plan --gpus N` listed N's divisors by a loop to N (its own copy of them): a typo hung it."""
    from longctx.config import load_config as load
    from longctx.costs.hardware import PRESETS
    from longctx.planner.request import Request

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        with pytest.raises(ConfigError, match=r"--gpus must be at most 10\*\*12"):
            Request(load(None, {}).model, PRESETS["h100"], LISTED_UP_TO * 8, 4096)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
