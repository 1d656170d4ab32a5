"""`bench moe --cluster --no-emulation` (a real cluster's own links) counts no bytes: only the emulated
links do (bench/emulated_link.py). Its JSON said `cross_node_bytes_flat` 0 and `cross_node_bytes_hierarchical`
0, which reads as "nothing crossed the nodes"; a figure not measured is null, as its exposed times are."""

import json

from longctx.cli import main


def run(capsys, *extra):
    assert main(["bench", "moe", "--cluster", "2x1", "--model", "debug-moe", "--tokens", "64", "--layers", "1",
                 "--repeats", "1", "--chunks", "2", "--zipf", "0", "--slowdown", "1", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_bytes_not_counted_are_null_not_zero(capsys):
    real = run(capsys, "--no-emulation")
    assert real["cross_node_bytes_flat"] is None and real["cross_node_bytes_hierarchical"] is None
    assert all(r["cross_node_bytes"] is None for s in real["schedules"].values() for r in s["repeats"])
    assert real["cross_node_ratio"] is None and real["exposed_comm_sequential"] is None
    emulated = run(capsys)  # (the control: the emulated links count what crossed, 2 nodes of one rank each)
    assert emulated["cross_node_bytes_flat"] > 0 and emulated["cross_node_bytes_hierarchical"] > 0
