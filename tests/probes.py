"""Test probes shared by several test files."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any op outputs (among those `keep` accepts):
    shows that a chunked computation never materialises the whole thing."""

    def __init__(self, keep=lambda t: True):
        super().__init__()
        self.largest, self.keep = 0, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.keep(t):
                self.largest = max(self.largest, t.numel())
        return out
