"""`longctx plan --calibrate --calibrate-out FILE` writes the measured machine "as TOML (for --hardware)", every
field of it, `source` included; `--hardware FILE` then failed with a TypeError (two values for `source`), with or
without --hw overrides, so a calibration could never be reused."""

from longctx.costs.hardware import Hardware, load_hardware


def _calibrated() -> Hardware:  # what calibrate() returns on a CPU, without the seconds of measuring
    return Hardware(name="cpu-measured", memory_gib=23.5, peak_tflops=0.03, intra_gbps=1.0, inter_gbps=1.0,
                    host_link_gbps=5.0, host_memory_gib=0.0, gemm_efficiency=1.0, attention_efficiency=0.37,
                    comm_overlap=0.0, usable_memory_fraction=0.9, usable_host_fraction=0.0, dtype_bytes=4,
                    host_adam_gparams_per_s=1.54, source="measured: 1 processes x 1 thread on 2 cores")


def test_calibrate_out_file_loads_as_hardware(tmp_path):
    f = tmp_path / "cpu.toml"
    f.write_text(_calibrated().to_toml())
    hw = load_hardware(str(f))
    assert (hw.name, hw.memory_gib, hw.dtype_bytes, hw.usable_host_fraction) == ("cpu-measured", 23.5, 4, 0.0)
    assert hw.source.startswith("measured: 1 processes")


def test_calibrate_out_file_takes_overrides(tmp_path):
    f = tmp_path / "cpu.toml"
    f.write_text(_calibrated().to_toml())
    hw = load_hardware(str(f), ["host_memory_gib=16", "usable_host_fraction=0.8"])
    assert (hw.host_memory_gib, hw.usable_host_fraction, hw.memory_gib) == (16.0, 0.8, 23.5)
    assert hw.source.startswith("measured: 1 processes")
