"""Issue 49 item 4: the planner plans one GPU. It searches memory.model_states (device,
host_optimizer, host) with the recompute / offload policies and chunk sizes, prints device and host
bytes and a step time with the host link's and the host AdamW's share, and says plainly when a plan
needs more host memory than the hardware has."""

import dataclasses
import json

import pytest

from longctx.cli import main
from longctx.config import load_config
from longctx.costs.hardware import get_hardware
from longctx.costs.host_bytes import host_state_bytes
from longctx.costs.shape import MeshShape
from longctx.planner.search import Request, plan

GIB = 2**30


def llama8b():
    return load_config(None, {"model": {"preset": "llama3-8b"}}).model


def plan_json(capsys, *args: str) -> tuple[int, dict, str]:
    rc = main(["plan", "--model", "llama3-8b", "--gpus", "1", *args, "--json", "--no-write"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


@pytest.mark.parametrize("hardware, seq", [("h100", "512K"), ("h200", "1M")])
def test_one_gpu_8b_is_feasible_with_its_states_in_host_memory(capsys, hardware, seq):
    rc, res, _ = plan_json(capsys, "--seq-len", seq, "--hardware", hardware)
    assert rc == 0 and res["feasible"] > 0
    best = res["plans"][0]
    assert best["feasible"] and best["policy"]["model_states"] in ("host_optimizer", "host")
    # it names the host memory it needs: the 8B's fp32 states alone are 16 x 8.03e9 bytes = 119.7 GiB, and more
    # where pinned: torch's host allocator rounds each pinned tensor up to a power of two (costs/host_bytes.py)
    tier = best["policy"]["model_states"]
    assert best["host_gib"]["model_states"] == pytest.approx(
        host_state_bytes(llama8b(), MeshShape(), tier, pinned=True) / GIB)
    assert 16 * 8.03e9 / GIB * 0.99 < best["host_gib"]["model_states"] < 16 * 8.03e9 / GIB * 1.06
    assert best["host_per_node_gib"] == pytest.approx(best["host_gib"]["total"])
    assert best["host_per_node_gib"] > 119
    assert best["memory_gib"]["total"] <= res["request"]["hardware"]["memory_gib"] * 0.92
    # the step time carries the host AdamW (8.03e9 parameters at the preset's 5e9/s: exposed in full
    # under host, hidden behind the next forward at world 1 under host_optimizer) and the host link
    times = best["times_s"]
    adam = 8.03e9 / 5e9
    if best["policy"]["model_states"] == "host":
        assert times["exposed_host_adam"] == pytest.approx(adam, rel=0.01)
    assert 0 <= times["exposed_host_adam"] <= adam * 1.01 and times["exposed_host_link"] >= 0
    assert times["step"] == pytest.approx(sum(v for k, v in times.items() if k != "step"))


def test_the_table_shows_the_tier_and_host_bytes(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "1", "--seq-len", "512K", "--hardware", "h100",
                 "--no-write"]) == 0
    head, first = capsys.readouterr().out.splitlines()[1:3]
    assert "states in" in head and "host/GPU" in head and "host/node" in head
    assert " host " in first or " host_optimizer " in first


def test_a_plan_needing_more_host_memory_than_the_node_has_says_so(capsys):
    rc, res, err = plan_json(capsys, "--seq-len", "512K", "--hardware", "h100", "--hw", "host_memory_gib=128")
    assert rc == 2 and res["feasible"] == 0
    text = " ".join(res["suggestions"])
    states = host_state_bytes(llama8b(), MeshShape(), "host", pinned=True) / GIB  # (pinned: rounded, 125.8)
    assert "host memory the hardware does not have" in text and f"model states {states:.1f}" in text
    assert "102.4 GiB usable of 128" in text and "--hw host_memory_gib=" in text


def test_host_tiers_only_where_the_device_tier_does_not_fit():
    """Multi-GPU plans keep their best plan: a host tier is taken for a candidate only when the
    device tier does not fit it (a host tier adds time to the same compute)."""
    req = Request(llama8b(), get_hardware("h100"), 8, 2**20)
    with_tiers, device_only = plan(req), plan(dataclasses.replace(req, model_states=("device",)))
    assert with_tiers.best.as_dict() == device_only.best.as_dict()
    assert len(with_tiers.feasible) >= len(device_only.feasible)
    for e in with_tiers.feasible:
        assert e.model_states == "device" or e.times["exposed_host_adam"] > 0


def test_unknown_tier_is_refused():
    from longctx.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown model-state tier"):
        Request(llama8b(), get_hardware("h100"), 1, 2**19, model_states=("hbm",))
