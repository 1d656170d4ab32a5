"""A dispatch-mode probe shared by the decode-attention benchmarks (sharded_verify.py, sharded_infllm_span.py):
the largest fp32 tensor any op but a view or the attention kernel makes, in bytes. Imported by name (a
benchmark runs as a script, its directory first on sys.path)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestFp32(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "_scaled_dot_product" not in str(func) and not func.is_view:  # (a view makes no bytes)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.largest = max(self.largest, t.numel() * 4)
        return out
