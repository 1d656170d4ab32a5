"""The SwiGLU feed-forward, w2(silu(w1 x) * w3 x): a dense block's MLP (models/llama.py) and the
shared experts of a Mixture of Experts (models/moe.py). Its own module so that both import it and
neither imports the other."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
