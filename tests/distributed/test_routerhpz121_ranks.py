"""An MoE router's own FSDP unit (the blocks gather bf16, a GPU's policy, made so here on CPU: the router gathers its
gate in fp32, parallel/fsdp/shard.py) under hpz behaves as a block's unit does: its forward gathers over the FSDP
group, leaves the node-sharded copy, and its backward gathers within the node.

Until 2026-12-07 Router.forward called `logits`, which shard_model registers as an FSDP forward method (for the
MoE layer's calls outside forward), so FSDP2 ran a nested forward: the inner post-forward made the node copy and
set the unit idle, the outer one then resharded fully. The copy was orphaned (held until the next forward) and the
backward gathered the gate over all 4 ranks instead of the node's 2, across nodes, which hpz promises not to do
(debug-moe, 4 ranks as 2 nodes of 2: each rank sent 9,216 B of fp32 gathers over the 4 ranks in backward, none
within the node; the job sent 18,432 B a step across nodes beyond the planner's figure; each rank held 3 x 2,048 B
of router copies after a step and after an evaluation). Router.forward now reads `_logits`; the routers' units
join `model.node_sharded_units`, which evaluation unshards from the copy and reshards (reshard_units).

Checked over 4 gloo ranks as 2 nodes of 2: the routers' fp32 gathers by group size in one step; the whole job's
bytes per link level against the planner's (planner/slow_links.py link_level_bytes, the routers' own units with
hpz's backward inside the node) as tests/link_audit.py RawLinks counts them; the bytes held across an evaluation;
and, training 3 steps under hpz and under plain FSDP, each step's loss, each gradient (gathered whole, before the
optimizer's step) and each parameter after it, to the bit."""

import hashlib
from collections import defaultdict

import pytest
import torch

from link_audit import RawLinks, _bytes
from live_storage import held_bytes
from longctx.config import load_config
from longctx.costs.hardware import PRESETS
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned
from longctx.memory.policy import MemoryPolicy
from longctx.planner.cost import estimate
from longctx.planner.expert_levels import expert_sent_per_micro_batch
from longctx.planner.slow_links import link_level_bytes

pytestmark = pytest.mark.slow  # one 4-rank job of 3 Trainers: ~60 s on a 2-core CPU

NODES, RANKS, SEQ, STEPS = 2, 2, 224, 3
ZERO_PP = "hpz,qwz,qgz"  # (the ZeRO++ layout the planner's link levels describe: bench comm's zeropp)
GATHERS = ("_allgather_base_", "allgather_into_tensor_coalesced_")


def _config(work: str, name: str, zero_pp: str, evaluates: bool = False):
    """debug-moe's Trainer over 4 ranks (nodes of 2 under zero_pp); `evaluates`: with an eval set (its interval
    past the steps run: the test calls evaluate itself)."""
    over = ["--model.preset=debug-moe", f"--train.seq_len={SEQ}", "--train.global_batch=4",
            f"--train.eval_interval={100 if evaluates else 0}",
            "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300", "--train.warmup_steps=2",
            f"--train.steps={STEPS}", "--model.max_seq_len=256", f"--train.run_dir={work}/{name}",
            "--checkpoint.final=false"]
    if zero_pp:
        over += [f"--parallel.zero_pp={zero_pp}", f"--parallel.ranks_per_node={RANKS}",
                 "--parallel.zero_pp_kernels=eager"]
    return load_config(None, over)


class _RouterGathers(RawLinks):
    """RawLinks, and apart the fp32 all-gathers' bytes by group size: the routers' alone (under qwz the blocks'
    units gather int8, the root too; without it they gather bf16 here)."""

    def __init__(self, ranks_per_node: int):
        super().__init__(ranks_per_node)
        self.fp32: dict[int, int] = defaultdict(int)

    def _record(self, name, args) -> None:
        super()._record(name, args)
        if name in GATHERS and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.float32:
            n = torch.distributed.ProcessGroup.unbox(args[2]).size()
            self.fp32[n] += _bytes(args[1]) * (n - 1)


def _counted(work: str) -> dict:
    """Step 2 under ZeRO++ counted (step 1: FSDP's lazy set-up), then the bytes held around an evaluation."""
    import torch.distributed as dist

    from longctx.train.trainer import Trainer

    trainer = Trainer(_config(work, "counted", ZERO_PP, evaluates=True), log=lambda *a, **k: None)
    trainer.step(1)
    links = _RouterGathers(RANKS)
    with links:
        trainer.step(2)
    levels = torch.tensor([float(links.hops[k]) for k in ("inter", "intra", "group")], dtype=torch.float64)
    dist.all_reduce(levels)  # (outside the count)
    copies, before = [_node_copies(trainer.model)], held_bytes()
    trainer.evaluate()
    held = held_bytes() - before
    copies.append(_node_copies(trainer.model))
    return {"levels": levels.tolist(), "router_gathers": dict(links.fp32), "unknown": links.summary()["unknown"],
            "held": held, "copies": copies, "node_sharded": len(trainer.model.node_sharded_units)}


def _node_copies(model) -> int:
    """Bytes of the node-sharded copies (FSDP2's post-forward shards) every unit of `model` holds now."""
    from torch.distributed.fsdp import FSDPModule

    groups = {id(g): g for m in model.modules() if isinstance(m, FSDPModule)
              for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None}
    return sum(p._sharded_post_forward_param_data.nbytes for g in groups.values() for p in g.fsdp_params
               if getattr(p, "_sharded_post_forward_param_data", None) is not None)


def _digest(tensors) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.full_tensor().detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _steps(work: str, zero_pp: str) -> list:
    """Each step's loss, a digest of every gradient (whole) before the optimizer's step and of every parameter
    (whole) after it."""
    from longctx.train.trainer import Trainer

    trainer, seen = Trainer(_config(work, zero_pp or "plain", zero_pp), log=lambda *a, **k: None), []
    params = list(trainer.model.parameters())
    grads = []
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(_digest(p.grad for p in params)))
    for step in range(1, STEPS + 1):
        loss = trainer.step(step)[0]
        seen.append((float(loss), grads[-1], _digest(params)))
    return seen


def _job(work: str) -> dict:
    from longctx.parallel.fsdp import shard

    shard.gathers_in_bf16 = lambda device_type, dtype: True  # as on a GPU (this rank's process only)
    return {"counted": _counted(work), "hpz": _steps(work, "hpz"), "plain": _steps(work, "")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_spawned(NODES * RANKS, _job, str(tmp_path_factory.mktemp("routerhpz")), timeout=600)


def _gate_bytes() -> int:
    m = load_config(None, ["--model.preset=debug-moe"]).model
    return 4 * m.moe_experts * m.dim  # fp32


def test_a_routers_backward_gathers_within_the_node(ranks):
    """Per rank and step, 3 routers: forward over the 4 ranks (a quarter of the gate, sent 3 times), backward over
    the node's 2 (the node copy, half the gate, sent once). Was: both over the 4 ranks, {4: 18,432}."""
    routers, gate = 3, _gate_bytes()
    for rank in ranks:
        assert rank["counted"]["router_gathers"] == {4: routers * gate // 4 * 3, 2: routers * gate // 2}


def test_the_planners_link_levels_are_what_the_ranks_send(ranks):
    shape = MeshShape(1, 4, zero_pp=ZERO_PP, node=RANKS)
    model = load_config(None, ["--model.preset=debug-moe"]).model
    hw = PRESETS["h100"].replace(dtype_bytes=2, name="cpu-bf16-gathers")  # the blocks gather bf16, as here
    est = estimate(model, hw, shape, MemoryPolicy("none"), seq_len=SEQ, global_batch=4, micro_batch=1,
                   gpus_per_node=RANKS, doc_mask=False)
    want = link_level_bytes(model, shape, hw, RANKS, expert_sent_per_micro_batch(est.comm_bytes, est.grad_accum))
    got = ranks[0]["counted"]
    assert got["unknown"] == []
    inter, intra, group = got["levels"]
    assert want == {"inter_node_bytes": int(inter), "intra_node_bytes": int(intra + group),
                    "intra_group_bytes": int(group)}


def test_no_router_copy_is_left_held(ranks):
    """After a training step and after an evaluation no unit holds a node copy (was: each router's, half the gate,
    6,144 B a rank after either), and an evaluation leaves no byte more held than it found."""
    for rank in ranks:
        assert rank["counted"]["copies"] == [0, 0]
        assert rank["counted"]["held"] == 0
        assert rank["counted"]["node_sharded"] == 4 + 3  # each block's unit (one block a unit) and each router's


def test_training_under_hpz_is_bit_identical_to_plain_fsdp(ranks):
    for rank in ranks:
        assert len(rank["hpz"]) == STEPS and rank["hpz"] == rank["plain"]
