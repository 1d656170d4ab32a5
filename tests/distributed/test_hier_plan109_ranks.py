"""The planner's count of hierarchical expert dispatch (parallel.expert_ranks_per_node) against what 4 gloo ranks
do: one MoE layer (fp32) over an expert group of 4 seen as 2 nodes of 2, its routing forced to every 2-subset of
the 8 experts once per rank (28 tokens), where uniform routing's expectations are exact (each token reaches
u = 1 - C(4,2)/C(8,2) = 22/28 remote nodes on average, each node-rank receives T k = 56 pairs):
- the bytes each rank sends on each link level (job/comm.py's counters, dims "expert_node" and "expert_local",
  forward and backward) equal costs/hier_bytes.py hier_expert_bytes, the planner's per-layer form;
- the bytes a call keeps for backward (memory/measured.py measure_activations, the accounting's own measure)
  exceed the flat exchange's by exactly memory/hier_counts.py hier_call_bytes: P (4d + 20) + S (8 + k) - T k (4d + 12),
  P = 56 pairs, S = 44 rows sent (28 x the 2 (1 - 6/28) nodes reached)."""

import copy
import sys
from itertools import combinations
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from longctx.config import ModelConfig
from longctx.costs.hier_bytes import hier_expert_bytes
from longctx.job import comm
from longctx.job.spawn import run_spawned
from longctx.memory.hier_counts import hier_call_bytes, nodes_reached
from longctx.memory.measured import measure_activations
from longctx.models.moe import MoEFeedForward
from longctx.parallel.context.volumes import expert_bytes
from longctx.parallel.expert.install import use_expert_parallel

pytestmark = pytest.mark.slow  # one 4-rank job, ~10 s on a 2-core CPU

LAYER = ModelConfig(dim=32, ffn_dim=64, moe_experts=8, moe_expert_dim=48, moe_top_k=2, moe_router="softmax")
CHOSEN = torch.tensor(list(combinations(range(8), 2)))  # [28, 2]: every pair of experts once
TOKENS = CHOSEN.shape[0]


class _Forced:
    """The MoE layer's documented routing hook (MoEFeedForward.pieces): every call routed to CHOSEN."""

    def route(self, layer, flat):
        return layer.route(flat, chosen=CHOSEN)


class _OneBlock(nn.Module):
    """measure_activations' model: one block (the MoE layer), a loss that keeps nothing of its output."""

    def __init__(self, moe):
        super().__init__()
        self.layers = nn.ModuleList([moe])
        self.register_buffer("g", torch.randn(TOKENS, LAYER.dim, generator=torch.Generator().manual_seed(7)))

    def forward(self, tokens, positions=None, doc_ids=None, labels=None):
        return (self.layers[0](tokens) * self.g).sum()


def _worker():
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    torch.manual_seed(0)
    base = MoEFeedForward(LAYER)
    base.pieces = _Forced()
    x = torch.randn(TOKENS, LAYER.dim, generator=torch.Generator().manual_seed(100 + torch.distributed.get_rank()))
    out = {}
    for name, per_node in (("flat", 0), ("hier2", 2)):
        model = _OneBlock(copy.deepcopy(base))
        use_expert_parallel(model, mesh, ranks_per_node=per_node)
        comm.reset_counters()
        held = measure_activations(model, x.clone().requires_grad_())  # (forward, then backward)
        out[name] = {"device": held["total_device"], "sent": comm.counters()}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_spawned(4, _worker)


def test_bytes_per_link_level_equal_the_planners(ranks):
    want = hier_expert_bytes(tokens=TOKENS, m=LAYER, expert=4, ranks_per_node=2, elem=4)
    print(f"predicted per rank: {want}")
    for r, got in enumerate(ranks):
        sent = got["hier2"]["sent"]
        print(f"rank {r} sent: {sent}")
        assert set(sent) == {"expert_node", "expert_local"}
        for dim in ("expert_node", "expert_local"):
            assert sent[dim] == pytest.approx(want[dim], abs=1e-6), (r, dim)
    # the flat exchange of the same routing, every row on one level: what hierarchy takes off the node boundary
    flat = expert_bytes(tokens=TOKENS, top_k=2, experts=8, dim=LAYER.dim, expert=4, elem=4)
    assert ranks[0]["flat"]["sent"]["expert"] == pytest.approx(flat)
    crossing_flat = flat["expert"] * 2 / 3  # (of a rank's 3 peers, the 2 on the other node)
    across = want["expert_node"]["expert_node"]
    print(f"rows' bytes across nodes per rank: flat {crossing_flat:.0f}, hierarchical {across:.0f}")
    assert across < crossing_flat


def test_saved_bytes_exceed_the_flat_exchanges_by_the_count(ranks):
    assert nodes_reached(8, 2, 2) * TOKENS == pytest.approx(44)
    want = hier_call_bytes(LAYER, 4, TOKENS, expert=4, ranks_per_node=2)
    assert want == pytest.approx(56 * (4 * 32 + 20) + 44 * (8 + 2) - 56 * (4 * 32 + 12))  # 888 B
    for r, got in enumerate(ranks):
        delta = got["hier2"]["device"] - got["flat"]["device"]
        print(f"rank {r}: flat {got['flat']['device']} B, hierarchical {got['hier2']['device']} B, "
              f"more {delta} B, predicted {want:.0f} B")
        assert delta == pytest.approx(want, abs=0.5)


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_plan_cli import CPU_HW as E2E_HW  # noqa: E402 (the e2e plans' CPU-sized "device")

CPU_HW = E2E_HW.replace("inter_gbps = 0.5", "inter_gbps = 0.05")  # (a link between nodes a tenth of the one inside)
assert CPU_HW != E2E_HW


def test_a_hierarchical_plan_is_written_and_trains(tmp_path):
    """`longctx plan --parallel.expert_ranks_per_node=2` on 4 CPU "GPUs" in nodes of 2 with a slow link between them
    chooses the hierarchy (expert 4 as 2 nodes of 2) and the written config trains 2 steps on 4 ranks."""
    import json
    import os
    import subprocess

    hw = tmp_path / "cpu.toml"
    hw.write_text(CPU_HW)
    out = tmp_path / "plan.toml"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def longctx(*args):
        return subprocess.run([sys.executable, "-m", "longctx", *args], capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=600)
    r = longctx("plan", "--model", "debug-moe", "--gpus", "4", "--gpus-per-node", "2", "--hardware", str(hw),
                "--seq-len", "256", "--global-batch", "4", "--expert", "4", "--out", str(out), "--json",
                "--parallel.expert_ranks_per_node=2", "--train.eval_interval=0", "--data.max_docs=60",
                "--metrics.plots=false", "--metrics.progress=false")
    assert r.returncode == 0, r.stderr[-3000:]
    best = json.loads(r.stdout)["plans"][0]
    assert best["layout"]["expert"] == 4 and best["layout"]["expert_ranks_per_node"] == 2, best["layout"]
    assert "expert_node" in best["comm_bytes_per_step"] and "expert" not in best["comm_bytes_per_step"]
    assert "expert_ranks_per_node = 2" in out.read_text()
    t = longctx("train", "--config", str(out), "--nproc", "4", "--train.steps", "2",
                f"--train.run_dir={tmp_path / 'run'}")
    assert t.returncode == 0, t.stderr[-3000:]
    assert "done: steps 1-2" in t.stdout
    # the run's expert bytes went over the two levels (train/metrics.py: rank 0's, routing as it fell)
    step1 = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["comm_bytes_per_step"]
    predicted = {d: sum(best["comm_bytes_per_step"][d].values()) for d in ("expert_node", "expert_local")}
    print(f"step 1 sent {step1}; planned (uniform routing) {predicted}")
    assert step1["expert_node"] > 0 and step1["expert_local"] > 0 and "expert" not in step1
