"""MoE calls with no rows: a rank whose share of a batch holds no token (a data-parallel degree above the
batch's rows) runs its layers on zero tokens, and an expert group may receive no row at all.

- the Sinkhorn router in training raised in sinkhorn() (max() of an empty tensor) on such a call, where
  the dropless and capacity layers run it (tests/unit/test_moe_dispatch_hook.py);
- grouped_mm on zero rows whose gradient arrives expanded (a .sum()'s: strides 0): _ContiguousGrad's
  .contiguous() keeps an empty tensor's zero strides, and torch._grouped_mm's backward refused them."""

import torch

from longctx.config import ModelConfig
from longctx.models.balanced_assignment import sinkhorn
from longctx.models.moe import MoEFeedForward
from longctx.ops.grouped import grouped_mm


def test_sinkhorn_router_trains_on_a_call_of_no_token():
    layer = MoEFeedForward(ModelConfig(dim=16, ffn_dim=32, moe_experts=4, moe_top_k=2, moe_expert_dim=24,
                                       moe_router="sinkhorn")).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 0, 16, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (1, 0, 16) and x.grad.shape == (1, 0, 16)
    assert sinkhorn(torch.empty(0, 4), 8).shape == (0, 4)


def test_grouped_mm_on_no_rows_takes_an_expanded_gradient():
    for dtype in (torch.float32, torch.bfloat16):  # (16-byte-aligned widths: the kernel's path where the build has it)
        x = torch.randn(0, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(4, 16, 8, dtype=dtype, requires_grad=True)
        y = grouped_mm(x, w, torch.zeros(4, dtype=torch.long))
        y.sum().backward()
        assert y.shape == (0, 8) and x.grad.shape == (0, 16) and not w.grad.any()


def test_rank_load_of_a_step_of_no_choice_is_balanced_not_nan():
    from longctx.train.router_metrics import rank_load

    assert rank_load(torch.zeros(2, 4), 2).item() == 1.0  # (was 0 / 0: NaN through the interval's mean)
    assert rank_load(torch.tensor([[3.0, 1, 0, 0], [0, 0, 0, 0]]), 2).item() == 2.0
