"""memory/hier_transients.py against what 4 gloo ranks hold: one MoE layer of debug-moe's shape (dim 128, 8 experts of
128, top-2; fp32) over an expert group of 4 seen as 2 nodes of 2 (parallel.expert_ranks_per_node = 2), its routing
forced to every 2-subset of the 8 experts, 4 times per rank (112 tokens), where uniform routing's expectations are
exact (P = T k = 224 pairs per node-rank, S = R_x = 112 x 2 (1 - 6/28) = 176 rows each way across nodes):
- the combine's backward (from the layer's output gradient to the experts' output gradient, tests/live_storage.py)
  holds hier_stage_bytes' "backward_combine", 3 P d e + P e;
- a stored call: the layer's backward peak equals the flat exchange's (the hierarchical stages fit in the
  feed-forward's count), and hier_transient_bytes counts 0 more;
- a recomputed call (torch.utils.checkpoint, as memory.recompute runs one): its backward peak exceeds the flat
  exchange's by what hier_transient_bytes counts, the forward combine run inside the backward (P + R_x + S + T rows
  of d against the count's 3 T k) and the recomputed call's saved bytes beyond the flat exchange's
  (hier_counts.hier_call_bytes), within 10% (the tolerance of test_shared_expert_overlap.py's transient check).
Each figure is the least of 3 runs: gloo's worker thread drops its hold on a finished transfer's buffers a little
after the caller's wait returns, so an unlucky run sees them a few ops longer."""

import copy
from itertools import combinations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from longctx.config import ModelConfig
from longctx.job.spawn import run_spawned
from longctx.memory.hier_transients import hier_stage_bytes, hier_transient_bytes
from longctx.memory.policy import MemoryPolicy
from longctx.memory.transients import ffn_backward_bytes
from longctx.models.moe import MoEFeedForward
from longctx.parallel.expert.install import use_expert_parallel

pytestmark = pytest.mark.slow  # one 4-rank job, ~20 s on a 2-core CPU

LAYER = ModelConfig(dim=128, ffn_dim=384, moe_experts=8, moe_expert_dim=128, moe_top_k=2, moe_router="softmax")
CHOSEN = torch.tensor(list(combinations(range(8), 2)) * 4)  # [112, 2]: every pair of experts 4 times
TOKENS = CHOSEN.shape[0]
REPEATS = 3


class _Forced:
    """The MoE layer's documented routing hook (MoEFeedForward.pieces): every call routed to CHOSEN."""

    def route(self, layer, flat):
        return layer.route(flat, chosen=CHOSEN)


def _backward(layer, x, recomputed: bool, marks: list) -> tuple[int, int]:
    """(the backward's peak, the combine's backward's peak) in live bytes created in it (live_storage.py)."""
    from live_storage import LiveStorages

    y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if recomputed else layer(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))  # (made before: not the backward's)
    mode = LiveStorages()
    marks.clear()
    marks.append(mode)
    with mode:
        y.backward(dy)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    combine_end = marks[1] if len(marks) > 1 else len(mode.steps)
    return mode.peak(), max(sum(live.values()) for live in mode.steps[:combine_end])


def _worker():
    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("expert_data", "expert"))
    torch.manual_seed(0)
    base = MoEFeedForward(LAYER)
    base.pieces = _Forced()
    x = torch.randn(TOKENS, LAYER.dim, generator=torch.Generator().manual_seed(100 + torch.distributed.get_rank()),
                    requires_grad=True)
    out = {}
    for name, per_node in (("flat", 0), ("hier2", 2)):
        layer = copy.deepcopy(base)
        use_expert_parallel(nn.Sequential(layer), mesh, ranks_per_node=per_node)
        marks: list = []  # [the backward's LiveStorages, the op count when the experts' output gradient is made]

        def mark_output_gradient(module, inputs, result, marks=marks):
            result.register_hook(lambda g: marks.append(len(marks[0].steps)))  # (returns None: result unchanged)
        layer.experts.register_forward_hook(mark_output_gradient)
        for recomputed in (False, True):
            runs = [_backward(layer, x, recomputed, marks) for _ in range(REPEATS)]
            out[name, recomputed] = {"peak": min(r[0] for r in runs), "combine": min(r[1] for r in runs)}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_spawned(4, _worker)


def test_the_combines_backward_holds_its_count(ranks):
    want = hier_stage_bytes(LAYER, TOKENS, expert=4, ranks_per_node=2, e=4)["backward_combine"]
    assert want == 3 * 224 * 128 * 4 + 224 * 4  # P = T k = 224 pairs: 3 of d each and their weights' gradient
    for r, got in enumerate(ranks):
        measured = got["hier2", False]["combine"]
        print(f"rank {r}: the combine's backward holds {measured} B, counted {want:.0f} B")
        assert want <= measured <= 1.1 * want, (r, measured, want)


@pytest.mark.parametrize("recomputed", [False, True], ids=["stored", "recomputed"])
def test_the_backward_peak_beyond_the_flat_exchanges_is_counted(ranks, recomputed):
    policy = MemoryPolicy("full" if recomputed else "none")
    want = hier_transient_bytes(LAYER, TOKENS, expert=4, ranks_per_node=2, policy=policy, e=4)
    ffn = ffn_backward_bytes(LAYER, TOKENS, 4, True)
    for r, got in enumerate(ranks):
        flat, hier = got["flat", recomputed]["peak"], got["hier2", recomputed]["peak"]
        print(f"rank {r} ({'recomputed' if recomputed else 'stored'}): backward peak flat {flat} B, hierarchical "
              f"{hier} B, more {hier - flat} B, counted {want:.0f} B (the feed-forward's count {ffn:.0f} B)")
        assert abs((hier - flat) - want) <= 0.1 * want, (r, hier - flat, want)
    if recomputed:  # the forward combine over the count, and the saved bytes: 7296 + 3552 B
        assert want == pytest.approx((224 + 176 + 176 + 112) * 128 * 4 - ffn + 3552)
    else:
        assert want == 0.0
