"""A calibration kept with `longctx plan --calibrate --calibrate-out FILE` and read back with `--hardware FILE`
(docs/planner.md) is a measurement for the number of processes it was taken for: each got 1/N of the RAM. Read
back for a plan of another number of ranks on this machine, each rank was planned with that share (a 1-process
calibration gave 2 ranks all of the RAM each), and the written plan was refused by `longctx train`'s preflight
(2 x 16 GiB of small-100m at 16K on a 23.5 GiB machine)."""

import argparse

import pytest

from longctx.costs.hardware import Hardware, calibrated_world
from longctx.errors import ConfigError
from longctx.planner.cli import add_arguments, build_request


def _file(tmp_path, world: int):
    hw = Hardware(name="cpu-measured", memory_gib=23.5 / world, peak_tflops=0.07, intra_gbps=1.0, inter_gbps=1.0,
                  host_link_gbps=5.0, host_memory_gib=0.0, gemm_efficiency=1.0, attention_efficiency=0.4,
                  comm_overlap=0.0, usable_memory_fraction=0.9, usable_host_fraction=0.0, dtype_bytes=4,
                  host_adam_gparams_per_s=1.54,
                  source=f"measured: {world} processes x 1 thread on 2 cores; all-to-all 1.00 GB/s")
    f = tmp_path / f"cpu{world}.toml"
    f.write_text(hw.to_toml())
    return str(f)


def _request(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return build_request(p.parse_args(["--model", "debug", "--seq-len", "4K", "--no-write", *argv]), [])[0]


def test_a_one_process_calibration_is_refused_for_two_ranks(tmp_path):
    with pytest.raises(ConfigError, match=r"calibration of this machine for 1 process.*puts 2 ranks.*--hw memory_gib"):
        _request("--gpus", "2", "--hardware", _file(tmp_path, 1))


def test_a_calibration_plans_the_ranks_it_was_measured_for(tmp_path):
    assert _request("--gpus", "2", "--hardware", _file(tmp_path, 2)).hardware.memory_gib == pytest.approx(11.75)
    assert _request("--gpus", "1", "--hardware", _file(tmp_path, 1)).hardware.memory_gib == pytest.approx(23.5)
    # one node's ranks are what share the machine: 16 GPUs in nodes of 2 are 2 ranks on it
    req = _request("--gpus", "16", "--gpus-per-node", "2", "--hardware", _file(tmp_path, 2))
    assert req.hardware.memory_gib == pytest.approx(11.75)


def test_a_memory_override_sizes_the_ranks_itself(tmp_path):
    req = _request("--gpus", "4", "--hardware", _file(tmp_path, 1), "--hw", "memory_gib=5")
    assert req.hardware.memory_gib == 5


def test_presets_and_files_without_a_measurement_record_no_world(tmp_path):
    from longctx.costs.hardware import PRESETS

    assert calibrated_world(PRESETS["h100"]) is None
    assert _request("--gpus", "4", "--hardware", "h100").hardware.name == "h100"
