"""`longctx plan --hardware cpu-measured` (or cpu, or a TOML file based on it) calibrates this machine
for the plan's ranks on it, as --calibrate does: each process gets 1 / world of the memory. It used to
calibrate for 4 processes whatever --gpus said, so a plan for 1 or 2 CPU ranks saw a quarter of the RAM."""

import argparse

import pytest

from longctx.costs import hardware
from longctx.planner.cli import add_arguments, build_request


def _args(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture
def calibrated_for(monkeypatch):
    worlds = []

    def fake(world=4, **_):
        worlds.append(world)
        return hardware.PRESETS["h100"].replace(name="cpu-measured", memory_gib=64 / world)

    monkeypatch.setattr(hardware, "calibrate", fake)
    return worlds


@pytest.mark.parametrize("spec", ["cpu-measured", "cpu"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_cpu_measured_preset_is_calibrated_for_the_planned_ranks(calibrated_for, spec, gpus):
    req, _ = build_request(_args(["--gpus", str(gpus), "--seq-len", "1024", "--hardware", spec]), [])
    assert calibrated_for == [gpus]
    assert req.hardware.memory_gib == 64 / gpus


def test_hardware_file_based_on_cpu_measured(calibrated_for, tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text('[hardware]\nbase = "cpu-measured"\nhost_link_gbps = 7.0\n')
    req, _ = build_request(_args(["--gpus", "16", "--gpus-per-node", "2", "--seq-len", "1024",
                                  "--hardware", str(f)]), [])
    assert calibrated_for == [2]  # the ranks of one node share this machine
    assert req.hardware.host_link_gbps == 7.0
