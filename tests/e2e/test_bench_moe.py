"""`longctx bench moe` as a user runs it, at tiny sizes: the JSON fields (not the timings)."""

import json
import subprocess
import sys

from test_newcomer import longctx_here


def test_bench_moe_reports_cost_routing_and_linear_memory():
    out = subprocess.run([sys.executable, "-m", "longctx", "bench", "moe", "--dim=32", "--seq-len=256,512",
                          "--memory-seq-len=128,256,512", "--repeats=1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["bench"] == "moe"
    assert doc["config"]["malloc"] == "freed blocks up to 1 GiB kept for reuse"  # as `longctx train` runs on CPU
    cfg, params = doc["config"], doc["active_params"]
    assert (cfg["experts"], cfg["top_k"], cfg["expert_dim"], cfg["dense_ffn_dim"]) == (8, 2, 32, 64)
    assert params["moe_experts"] == params["dense"]  # the same active parameters (router aside)
    rows = {(r["routing"], r["tokens"]): r for r in doc["timing"]}
    assert set(rows) == {(r, t) for r in ("uniform", "skewed") for t in (256, 512)}
    for r in rows.values():
        assert r["moe_cpu_s"] > 0 and r["dense_cpu_s"] > 0
        assert r["ratio"] == r["moe_cpu_s"] / r["dense_cpu_s"]
        assert abs(r["moe_cpu_s_per_token"] * r["tokens"] - r["moe_cpu_s"]) < 1e-12
        assert abs(sum(r["expert_share"]) - 1) < 1e-4 and len(r["expert_share"]) == 8
    for t in (256, 512):
        assert rows["skewed", t]["expert_share"][0] >= 0.5 - 1e-6  # expert 0 takes half of the top-2 choices
        assert rows["skewed", t]["load_max_over_mean"] >= 4 - 1e-4
        assert rows["uniform", t]["load_max_over_mean"] < 2
    memory = doc["memory"]
    assert [m["tokens"] for m in memory] == [128, 256, 512]
    # linear growth: the same bytes for every further token, on top of at most a per-call constant (the
    # grouped GEMM kernel's int32 offsets: 3 x 4 bytes per expert, where it runs; none in the dense layer)
    for key, most in (("moe_saved_bytes", 3 * 4 * 8), ("dense_saved_bytes", 0)):
        b = [m[key] for m in memory]
        slope = (b[1] - b[0]) / 128
        assert (b[2] - b[1]) / 256 == slope > 0 and 0 <= b[0] - 128 * slope <= most, (key, b)
    # the dense SwiGLU keeps its input and four [T, ffn] tensors (fp32): (dim + 4 ffn) x 4 bytes per token
    assert memory[0]["dense_bytes_per_token"] == (32 + 4 * 64) * 4
    assert memory[0]["moe_bytes_per_token"] > memory[0]["dense_bytes_per_token"]


def test_bench_moe_cluster_reports_both_schedules_on_an_emulated_cluster():
    """2 nodes x 1 rank, tiny sizes: the JSON keys, and one figure the emulation fixes: bytes sent
    across nodes are every routed row that leaves the node, the same for both schedules."""
    out = subprocess.run([sys.executable, "-m", "longctx", "bench", "moe", "--cluster=2x1", "--model=debug-moe",
                          "--tokens=64", "--layers=1", "--repeats=1", "--chunks=2", "--link-scale=1000", "--zipf=0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["bench"] == "moe_cluster" and doc["cluster"] == "2x1"
    for key in ("sequential_s", "scheduled_s", "exposed_comm_sequential", "exposed_comm_scheduled"):
        assert doc[key] > 0, key
    assert doc["scheduled_chunks"] == 2
    assert set(doc["schedules"]) == {"sequential", "scheduled_2"}
    link = doc["config"]["link"]
    assert link["ranks_per_node"] == 1 and link["inter_bytes_per_s"] > 0
    flat = doc["cross_node_bytes_flat"]
    assert flat > 0 and doc["schedules"]["scheduled_2"]["cross_node_bytes"] == flat
    # one rank per node: every choice on the other node crosses; hierarchically, once per token
    assert 0 < doc["cross_node_bytes_hierarchical"] < flat and doc["hierarchical_s"] > 0



def test_bench_moe_cluster_reports_flexmoe_under_zipf_routing():
    """4 ranks, Zipf(1.2) routing: the static placement's rows are skewed, FlexMoE's copies even
    them out (the rows are counted from the real routing, not predicted)."""
    out = subprocess.run([sys.executable, "-m", "longctx", "bench", "moe", "--cluster=2x2", "--model=debug-moe",
                          "--tokens=256", "--layers=1", "--repeats=1", "--chunks=2", "--link-scale=1000",
                          "--zipf=1.2", "--replicas=1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    for key in ("skew_step_static_s", "skew_step_flexmoe_s"):
        assert doc[key] > 0, key
    assert doc["skew_max_load_static"] > 1.5 and doc["skew_max_load_flexmoe"] <= 1.15
    skew = doc["skew"]
    assert skew["copies"] > 0 and sum(skew["rows_static"]) == sum(skew["rows_flexmoe"]) == 4 * 256 * 2


def test_bench_moe_cluster_rejects_a_bad_cluster():
    out = longctx_here("bench", "moe", "--cluster=2y4")  # (refused before any work: in this process)
    assert out.returncode != 0 and "NODESxRANKS" in out.stderr
