"""The planner's bytes per link level (planner/slow_links.py link_level_bytes, planner/expert_levels.py) against
what 4 gloo ranks send, as 2 nodes of 2, in a Trainer step of debug-moe (fp32 on the CPU, 224 tokens per rank)
whose every MoE layer is routed to each 2-subset of the 8 experts in turn (8 x the 28 pairs per rank and layer),
where uniform routing's expectations are exact (as tests/distributed/test_hier_plan109_ranks.py routes them):
flat ep4 (the expert group spans both nodes), hierarchical ep4 over nodes of 2 (expert_node across, expert_local
inside), ep2 (the experts' own FSDP units over an expert-data ring that crosses nodes), HSDP with ep4, ZeRO++
(hpz, qwz, qgz) with ep4, hierarchical ep4 and ep2 (the experts' units gather int8, the dense units as bench comm's
forms), debug-moe without expert parallelism (its router statistics' all-reduce) and the dense debug model,
unchanged. The bytes are
counted by tests/link_audit.py RawLinks from the c10d operators, each transfer booked on the hop it takes, every
rank's summed: the planner's figures are job totals of one micro-batch's step."""

from itertools import combinations

import pytest
import torch

from link_audit import RawLinks
from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cost import estimate
from longctx.planner.expert_levels import expert_sent_per_micro_batch
from longctx.planner.slow_links import link_level_bytes

pytestmark = pytest.mark.slow  # one 4-rank job of 9 Trainers, 2 steps each: ~40 s on a 2-core CPU

NODES, RANKS, SEQ = 2, 2, 224
CHOSEN = torch.tensor(list(combinations(range(8), 2)))  # [28, 2]: every pair of debug-moe's 8 experts
ZERO_PP = dict(zero_pp="hpz,qwz,qgz", node=2)
ZERO_PP_RUN = ["--parallel.zero_pp=hpz,qwz,qgz", "--parallel.zero_pp_kernels=eager"]
CASES = {  # name: (preset, MeshShape, the layout's overrides)
    "flat ep4": ("debug-moe", MeshShape(1, 4, expert=4), ["--parallel.expert=4"]),
    "hier ep4 R2": ("debug-moe", MeshShape(1, 4, expert=4, expert_ranks_per_node=2),
                    ["--parallel.expert=4", "--parallel.expert_ranks_per_node=2"]),
    "ep2": ("debug-moe", MeshShape(1, 4, expert=2), ["--parallel.expert=2"]),
    "rep2 ep4": ("debug-moe", MeshShape(2, 2, expert=4), ["--parallel.expert=4", "--parallel.dp_replicate=2"]),
    "moe ep1": ("debug-moe", MeshShape(1, 4), []),
    "zeropp ep4": ("debug-moe", MeshShape(1, 4, expert=4, **ZERO_PP), ["--parallel.expert=4", *ZERO_PP_RUN]),
    "zeropp hier ep4 R2": ("debug-moe", MeshShape(1, 4, expert=4, expert_ranks_per_node=2, **ZERO_PP),
                           ["--parallel.expert=4", "--parallel.expert_ranks_per_node=2", *ZERO_PP_RUN]),
    "zeropp ep2": ("debug-moe", MeshShape(1, 4, expert=2, **ZERO_PP), ["--parallel.expert=2", *ZERO_PP_RUN]),
    "dense": ("debug", MeshShape(1, 4), []),
}
LEVELS = ("inter_node_bytes", "intra_node_bytes", "intra_group_bytes")


class _Forced:
    """The MoE layer's routing hook (MoEFeedForward.pieces): a call's tokens routed to CHOSEN's pairs in turn."""

    def route(self, layer, flat):
        n = flat.shape[0]
        return layer.route(flat, chosen=CHOSEN.repeat(-(-n // len(CHOSEN)), 1)[:n])


def _links(work: str) -> dict:
    """Per case, the job's bytes per level in step 2 (step 1: FSDP's lazy set-up, the optimizer's state)."""
    import torch.distributed as dist

    from longctx.models.moe import MoEFeedForward
    from longctx.train.trainer import Trainer

    out = {}
    for name, (preset, _, extra) in CASES.items():
        cfg = load_config(None, [f"--model.preset={preset}", f"--train.seq_len={SEQ}", "--train.global_batch=4",
                                 "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                                 "--data.max_docs=300", "--train.warmup_steps=2", "--train.steps=3",
                                 f"--parallel.ranks_per_node={RANKS}", "--model.max_seq_len=256",
                                 f"--train.run_dir={work}/{name.replace(' ', '_')}", *extra])
        trainer = Trainer(cfg, log=lambda *a, **k: None)
        for layer in trainer.model.modules():
            if isinstance(layer, MoEFeedForward):
                layer.pieces = _Forced()
        trainer.step(1)
        links = RawLinks(RANKS)
        with links:
            trainer.step(2)
        levels = torch.tensor([float(links.hops[k]) for k in ("inter", "intra", "group")], dtype=torch.float64)
        dist.all_reduce(levels)  # (outside the count)
        out[name] = {"levels": levels.tolist(), "unknown": links.summary()["unknown"]}
        del trainer
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    return run_spawned(NODES * RANKS, _links, str(tmp_path_factory.mktemp("linklevels")))[0]


def planned(name: str) -> dict | None:
    """link_level_bytes of the case, its expert all-to-alls from the planner's own estimate (uniform routing)."""
    preset, shape, _ = CASES[name]
    model = load_config(None, [f"--model.preset={preset}"]).model
    hw = PRESETS["h100"].replace(dtype_bytes=4, name="cpu-test")  # fp32 gathers, as on the CPU
    est = estimate(model, hw, shape, MemoryPolicy("none"), seq_len=SEQ, global_batch=4, micro_batch=1,
                   gpus_per_node=RANKS, doc_mask=False)
    return link_level_bytes(model, shape, hw, RANKS, expert_sent_per_micro_batch(est.comm_bytes, est.grad_accum))


@pytest.mark.parametrize("name", list(CASES))
def test_the_planners_link_levels_are_what_the_ranks_send(counted, name):
    got = counted[name]
    assert got["unknown"] == []
    inter, intra, group = got["levels"]
    measured = {"inter_node_bytes": inter, "intra_node_bytes": intra + group, "intra_group_bytes": group}
    want = planned(name)
    print(f"{name}: planned {want}, sent {measured}")
    assert want == {k: int(measured[k]) for k in LEVELS}
    assert measured["inter_node_bytes"] > 0 and measured["intra_node_bytes"] > 0


def test_the_hierarchy_takes_bytes_off_the_node_boundary(counted):
    """Over 2 nodes of 2, each token's rows cross once per remote node instead of once per remote rank."""
    assert counted["hier ep4 R2"]["levels"][0] < counted["flat ep4"]["levels"][0]
