"""FSMoE's pipelined expert-parallel layer (parallel/expert/pipeline.py) against the plain one: one
MoE layer split over 4 expert ranks, the same inputs, outputs and every gradient within 1e-5, for
several chunk counts, uniform and skewed routing (an expert with fewer rows than chunks included).
Training under expert 4 x (head 2 x ctx 2) with chunks is in test_expert_parallel.py (LAYOUTS)."""

import copy
import time

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from longctx.config import ModelConfig
from longctx.job.spawn import run_spawned
from longctx.models.moe import MoEFeedForward
from longctx.parallel.expert.install import use_expert_parallel
from longctx.parallel.expert.pipeline import ChunkTuner, chunk_counts, chunk_rows

CHUNKS = (2, 3, 7)


def test_chunks_cover_every_row_once_in_group_order():
    counts = [5, 0, 1, 9]
    rows = chunk_rows(counts, 3)
    assert sorted(torch.cat(rows).tolist()) == list(range(15))
    per = chunk_counts(counts, 3)
    assert [sum(c[g] for c in per) for g in range(4)] == counts
    assert [len(r) for r in rows] == [sum(c) for c in per]
    assert rows[0].tolist() == [0, 6, 7, 8]  # group 0: row 0 of 5; group 3 (rows 6-14): its first 3
    assert rows[2].tolist() == [3, 4, 5, 12, 13, 14]  # group 2 has one row (5): in the last chunk


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _run(layer, x, grad):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad)
    return {"y": y.detach(), "x": x.grad, **{n: _local(p.grad).clone() for n, p in layer.named_parameters()}}


def _compare(skew: float):
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    cfg = ModelConfig(dim=32, ffn_dim=64, moe_experts=8, moe_top_k=2, moe_expert_dim=48, moe_router="softmax",
                      moe_shared_experts=1, moe_shared_dim=32)
    torch.manual_seed(0)  # the same weights on every rank
    base = MoEFeedForward(cfg)
    for p in base.experts.parameters():
        nn.init.normal_(p, std=0.05)
    base.router.expert_bias[0] = skew  # skewed: expert 0 in (nearly) every token's top 2
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens, a different count each
    x = torch.randn(1, 40 + 9 * rank, 32, generator=gen)
    grad = torch.randn(1, 40 + 9 * rank, 32, generator=gen)
    out = {}
    for chunks in (1, *CHUNKS):
        holder = nn.Sequential(copy.deepcopy(base))
        use_expert_parallel(holder, mesh, chunks)
        out[chunks] = _run(holder[0], x, grad)
    worst = {c: max((out[c][k] - out[1][k]).abs().max().item() for k in out[1]) for c in CHUNKS}
    return worst, sorted(out[1])


@pytest.mark.parametrize("skew", [0.0, 50.0], ids=["uniform", "skewed"])
def test_pipelined_layer_matches_the_plain_expert_parallel_layer(skew):
    results = run_spawned(4, _compare, skew)
    for worst, keys in results:
        assert {"y", "x", "experts.w1", "experts.w2", "experts.w3", "router.gate.weight"} <= set(keys)
        assert max(worst.values()) <= 1e-5, worst


class _OneRank:
    def size(self):
        return 1


def test_the_chunk_tuner_profiles_step_by_step_then_keeps_the_fastest():
    tuner = ChunkTuner(_OneRank())
    cost = {1: 0.060, 2: 0.005, 4: 0.025, 8: 0.045}  # seconds per call: 2 chunks fastest (gaps over sleep jitter)
    used, decisions = [], []
    for _ in range(1 + 2 * 4 + 3):
        decisions.append(tuner.begin_step())
        for _ in range(2):  # two layer calls per step, both at the step's count
            used.append(tuner.timed(lambda c: (time.sleep(cost[c]), c)[1]))
    assert used == [1] * 2 + [1] * 4 + [2] * 4 + [4] * 4 + [8] * 4 + [2] * 6
    made = [d for d in decisions if d is not None]
    assert len(made) == 1 and made[0]["chunks"] == 2 and decisions.index(made[0]) == 9
    assert made[0]["forward_s"][1] > made[0]["forward_s"][8] > made[0]["forward_s"][4] > made[0]["forward_s"][2]


def _train_auto(args, run_dir):
    from longctx.config import load_config
    from longctx.train.trainer import train

    lines = []
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
    losses = train(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a)))).losses
    return losses, [line for line in lines if "expert pipeline chunks" in line]


def test_a_run_with_chunks_chosen_online_logs_its_choice_and_trains_as_the_plain_one(tmp_path):
    from longctx.job.spawn import run_spawned_many

    base = ["--model.preset=debug-moe", "--train.steps=11", "--train.eval_interval=0", "--metrics.plots=false",
            "--metrics.progress=false", "--data.max_docs=200", "--train.seq_len=256", "--train.global_batch=4",
            "--parallel.expert=2", "--parallel.ctx=2"]
    jobs = [(name, _train_auto, ([*base, f"--parallel.expert_pipeline_chunks={c}"], str(tmp_path / name)))
            for name, c in (("plain", 1), ("auto", 0))]
    results = run_spawned_many(2, jobs)
    (plain, _), (auto, logged) = results["plain"][0], results["auto"][0]
    assert len(logged) == 1 and "step 10: expert pipeline chunks" in logged[0], logged
    assert max(abs(a - b) for a, b in zip(plain, auto, strict=True)) <= 1e-4


def _saved_expert_weights_are_weights():
    from torch.distributed.device_mesh import init_device_mesh

    from longctx.memory.offload import _is_weight

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("expert_data", "expert"))
    holder = nn.Sequential(MoEFeedForward(ModelConfig(dim=16, ffn_dim=32, moe_experts=4, moe_top_k=2,
                                                      moe_expert_dim=16)))
    use_expert_parallel(holder, mesh, 1)
    verdicts = []

    def pack(t):
        if tuple(t.shape) == (2, 16, 16):  # this rank's 2 experts' [in, out] weights the grouped GEMMs save
            verdicts.append(_is_weight(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        holder(torch.randn(8, 16, requires_grad=True)).sum().backward()
    return verdicts


def test_the_host_offloader_leaves_expert_weights_to_fsdp():
    """Under expert parallelism the experts' weights reach the grouped GEMMs through DTensor.to_local
    and the gradient-scaling identity: still weights, which FSDP gathers again for backward, so the
    offloader must not copy them to the host as activations."""
    for verdicts in run_spawned(2, _saved_expert_weights_are_weights):
        assert len(verdicts) == 3 and all(verdicts), verdicts
