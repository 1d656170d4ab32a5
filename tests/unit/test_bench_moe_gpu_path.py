"""`longctx bench moe --device cuda` says which path its `moe_kernel_s` timed: where the grouped kernel
cannot run (here: widths that are not a multiple of 16 bytes), the layer runs the loop, and a figure
named after the kernel (and its ratio to the loop) must not pass for the kernel's. Run on the CPU in
bf16 (moe_gpu.main's own check path)."""

import argparse
import json

import torch

from longctx.bench import moe as bench
from longctx.bench import moe_gpu


def _run(capsys, dim, expert_dim, *extra):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--dim", str(dim), "--experts", "4", "--expert-dim", str(expert_dim), "--seq-len", "32",
                         "--routing", "uniform", "--repeats", "1", *extra])
    assert moe_gpu.main(args, device=torch.device("cpu")) == 0
    return json.loads(capsys.readouterr().out)


def test_a_layer_the_kernel_cannot_run_is_not_reported_as_the_kernel(capsys):
    doc = _run(capsys, 36, 20)  # 36 bf16 values = 72 bytes: not a multiple of 16
    assert doc["config"]["grouped"].startswith("loop")
    assert doc["timing"][0]["kernel_over_loop"] is None


def test_the_kernel_path_is_named_where_it_runs(capsys):
    from longctx.ops.grouped import cpu_kernel_available

    doc = _run(capsys, 32, 16)
    if cpu_kernel_available():
        assert doc["config"]["grouped"] == "torch._grouped_mm"
        assert doc["timing"][0]["kernel_over_loop"] > 0


def test_profile_gives_each_layers_ops_by_kind(capsys):
    """--profile (for the next lent GPU: where the MoE layer's time goes beside the dense one's): on the CPU the
    aten ops' CPU time, the dense layer's matmuls among them; the timed figures are not the profiled run's."""
    row = _run(capsys, 32, 16, "--profile")["timing"][0]
    assert set(row["profile"]) == {"moe", "dense"}
    for table in row["profile"].values():
        assert table["time"] == "CPU (aten ops)" and 0 < len(table["top"]) <= 15
        assert sum(k["share"] for k in table["by_kind"].values()) > 0.999
    assert row["profile"]["dense"]["by_kind"]["matmul"]["self_s"] > 0
    assert "profile" not in _run(capsys, 32, 16)["timing"][0]
