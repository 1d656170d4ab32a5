"""memory.block_chunk: a block run in pieces (memory/apply_policy.py _in_parts) takes its pieces of the block
input and of the attention output as the views of one split, so their gradients are joined once. As slices,
each piece's gradient was made full size (zeros elsewhere) and added to the sum so far: per piece, two
full-size [tokens, dim] tensors made for the block input and two for the attention output (at 512K tokens
in 64 pieces, ~4 TiB of memory traffic per llama3-8b block's backward)."""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from longctx.config import load_config
from longctx.memory.apply_policy import apply_memory_policy
from longctx.models.llama import build_model

SEQ, DIM, CHUNK = 512, 32, 64


class FullSize(TorchDispatchMode):
    """Counts, by op, the tensors of SEQ x DIM elements made (new storage, not a view) while `counting`."""

    def __init__(self):
        super().__init__()
        self.made, self.counting = collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting and isinstance(out, torch.Tensor) and out.numel() == SEQ * DIM:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            inputs = {t.untyped_storage().data_ptr() for t in tensors}
            if out.untyped_storage().data_ptr() not in inputs:
                self.made[str(func.overloadpacket.__name__)] += 1
        return out


def test_the_pieces_gradients_are_joined_once_per_block():
    cfg = load_config(None, {"model": {"preset": "debug", "dim": DIM, "layers": 2, "heads": 2, "kv_heads": 1,
                                       "ffn_dim": 64, "vocab_size": 64}})
    model = build_model(cfg.model, seed=0)
    apply_memory_policy(model.layers, "full", 0.0, block_chunk=CHUNK)
    tokens = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    mode = FullSize()
    with mode:
        loss = model(tokens, labels=tokens)
        mode.counting = True
        loss.backward()
    pieces = SEQ // CHUNK
    # before: per block 2 x pieces full-size slice gradients, and as many full-size sums
    assert mode.made["slice_backward"] == 0, mode.made
    assert mode.made["add"] < pieces, mode.made
