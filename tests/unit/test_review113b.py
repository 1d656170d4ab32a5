"""Review of the CUDA runtime's host term (review113b): `longctx plan`'s host/GPU and host/node columns count each
GPU rank's CUDA context and libraries since costs/cuda_runtime.py (planner/cost.py footprint_of), but the table's
legend still said they hold "a host tier's states, offloaded activations, the data loader's batches": a plan with
the states on the device and nothing offloaded read 1.0 GiB of host memory per GPU that no listed part explains.
The legend now names the runtime, on GPU hardware only. The table is read as a user reads it, from stdout."""

import re

from longctx.cli import main


def plan_text(capsys, *hardware: str) -> tuple[str, float]:
    """(the legend, joined into one line; the first row's host/node GiB) of the debug model's plan on 1 GPU."""
    assert main(["plan", "--model", "debug", "--gpus", "1", "--seq-len", "4096", "--no-write", *hardware]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[1]
    at = head.index("host/node")
    first = lines[2]
    host_node = float(first[at:].split()[0])
    legend = " ".join(lines[lines.index(next(x for x in lines if x.startswith("memory per GPU"))):])
    return legend, host_node


def test_the_plan_legend_names_the_cuda_runtime_its_host_columns_count(capsys):
    legend, host_node = plan_text(capsys, "--hardware", "h100")
    # the best plan keeps its states on the GPU and offloads nothing, yet holds about a GiB of host memory (and the
    # rank's interpreter, 0.3 GiB: costs/rank_process.py)
    assert 1.2 <= host_node <= 1.4, host_node
    assert re.search(r"host/GPU, host/node = .*CUDA context and libraries \(0\.95 GiB", legend), legend


def test_a_cpu_calibrations_plan_legend_names_no_cuda_runtime(capsys):
    legend, host_node = plan_text(capsys, "--hardware", "h100", "--hw", "name=cpu-test")
    assert host_node < 0.4, host_node  # (the rank's interpreter alone, 0.3 GiB: costs/rank_process.py)
    assert "host/GPU, host/node" in legend and "CUDA" not in legend, legend
