"""What `longctx bench moe` shares between its CPU and GPU halves (moe.py, moe_gpu.py): the layers
it builds, the routing it skews, one forward + backward, how it reports."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import ModelConfig
from ..errors import ConfigError
from ..models.llama import FeedForward
from ..models.moe import MoEFeedForward
from ..progress import speaker


def ratio(a: float, b: float) -> float:
    """a / b, where a CPU time below the clock's resolution (tiny sizes) reads as that resolution, not 0."""
    tick = time.get_clock_info("process_time").resolution
    return max(a, tick) / max(b, tick)


say = speaker("[bench moe] ")


def build_layers(args) -> tuple[MoEFeedForward, FeedForward, ModelConfig]:
    expert_dim = args.expert_dim or args.dim
    cfg = ModelConfig(dim=args.dim, ffn_dim=args.top_k * expert_dim, moe_experts=args.experts, moe_top_k=args.top_k,
                      moe_expert_dim=expert_dim, moe_router="softmax")
    torch.manual_seed(args.seed)
    moe, dense = MoEFeedForward(cfg), FeedForward(args.dim, cfg.ffn_dim)
    std = 0.02
    for p in (*moe.experts.parameters(), *dense.parameters()):
        nn.init.normal_(p, std=std)
    return moe, dense, cfg


def measured_active_params(moe: MoEFeedForward, dense: FeedForward, top_k: int) -> dict:
    per_expert = sum(p[0].numel() for p in moe.experts.parameters())
    router = moe.router.gate.weight.numel()
    return {"dense": sum(p.numel() for p in dense.parameters()), "moe_experts": top_k * per_expert,
            "moe_router": router, "moe_total": sum(p.numel() for p in moe.parameters())}


def choice_share(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """[E] the share of all choices each expert gets for tokens x."""
    with torch.no_grad():
        chosen = moe.router(x.reshape(-1, x.shape[-1])).experts.flatten()
    return torch.bincount(chosen, minlength=moe.num_experts).double() / chosen.numel()


def skew(moe: MoEFeedForward, x: torch.Tensor, share: float) -> float:
    """Raise expert 0's selection bias (bisection) until it takes `share` of the choices; returns the bias."""
    if not 0 < share <= 1 / moe.top_k + 1e-9:
        raise ConfigError(f"--skew-share {share}: one expert can take at most 1 / top-k = "
                          f"{1 / moe.top_k:g} of the choices (every token once).")
    lo, hi = 0.0, 2.0  # probabilities are in [0, 1]: a bias of 1 already puts expert 0 in every top-k
    for _ in range(40):
        mid = (lo + hi) / 2
        moe.router.expert_bias[0] = mid
        lo, hi = (lo, mid) if float(choice_share(moe, x)[0]) >= share - 1e-9 else (mid, hi)
    moe.router.expert_bias[0] = hi
    return hi


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def aten_ops(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    """The aten operations one forward + backward of `layer` issues (after a warm-up), as they pass
    the dispatcher: what a per-expert loop would make grow with the experts (tests/unit/test_moe_op_count.py)."""
    fwd_bwd(layer, x, grad)
    with _OpCount() as count:
        fwd_bwd(layer, x, grad)
    return count.ops


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    layer(x).backward(grad)
    x.grad = None
    for p in layer.parameters():
        p.grad = None
