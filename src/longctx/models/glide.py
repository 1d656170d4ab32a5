"""GliDe: a draft model whose layers read the target's KV cache (the draft half of GliDe with a CaPE).

Draft layer i of N: self-attention over the draft's own tokens (causal), then a cross-attention whose
query (RoPE at the token's position) attends to the target's cached keys and values of target layer
L_t - N + i, then a SwiGLU MLP. The cross-attention owns only a query and an output projection:
its keys and values are the target's, as cached (grouped like the target's: GQA). The draft has
no embedding or LM head of its own: it uses the target's (frozen), passed to `forward`. So it has
no long cache to fill at long context: the target's, which exists anyway, is what it reads.

Which of the target's positions a draft position sees is `visible` (per query: the slots before
it may read). At decode time that is what the target's cache holds: the prompt and every accepted
token, so every proposal of a round sees the cache as of the last verification. Training sees the
same thing with `block_stale_visible`: position t sees the target's positions before the start of
its block of `block` tokens (block = the speculation length), t // block * block of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .llama import Attention, RMSNorm, apply_rope, rope_attention_scale, rope_cos_sin, rope_inv_freq
from .swiglu import FeedForward


def block_stale_visible(seq_len: int, block: int, device=None) -> torch.Tensor:
    """[seq_len]: how many target positions each position sees in training (its block's start)."""
    return torch.arange(seq_len, device=device) // block * block


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    chunk: int = 1024) -> torch.Tensor:
    """q [b, n, heads, d] against the target's k/v [b, kv_heads, S, d]: query i of row r sees slots
    < visible[r, i] ([b, n]). A query that sees none gets 0. Queries go `chunk` at a time, so the
    mask is [chunk, S], never [n, S] at once."""
    b, n, heads, d = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [b, heads, S, d]
    slots = torch.arange(k.shape[2], device=q.device)
    outs = []
    for start in range(0, n, chunk):
        qc, vis = q[:, start:start + chunk].transpose(1, 2), visible[:, start:start + chunk]
        mask = slots[None, None, :] < vis[:, :, None]                               # [b, c, S]
        out = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask[:, None])     # [b, heads, c, d]
        outs.append(torch.where((vis > 0)[:, None, :, None], out, torch.zeros_like(out)))
    return torch.cat(outs, dim=2).transpose(1, 2)


class GlideLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        heads, hd = cfg.heads, cfg.resolved_head_dim
        self.self_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attention = Attention(cfg)
        self.cross_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.cross_q = nn.Linear(cfg.dim, heads * hd, bias=False)
        self.cross_o = nn.Linear(heads * hd, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.heads, self.head_dim = heads, hd

    def forward(self, x, cos, sin, target_k, target_v, visible, cache=None):
        """cache: this layer's models/cache.py LayerCache for the draft's own keys (decode), or None
        (the whole sequence, causal)."""
        b, n, _ = x.shape
        if cache is None:
            h = x + self.self_attention(self.self_norm(x), cos, sin, None)
        else:
            q, k, v = self.self_attention.qkv(self.self_norm(x), cos, sin)
            h = x + self.self_attention.wo(cache.attend(q, k, v).flatten(2))
        q = apply_rope(self.cross_q(self.cross_norm(h)).view(b, n, self.heads, self.head_dim), cos, sin)
        h = h + self.cross_o(cross_attention(q, target_k, target_v, visible).flatten(2))
        return h + self.feed_forward(self.ffn_norm(h))


class GlideDraft(nn.Module):
    """N GliDe layers over a target of `cfg` (its dims), reading target layers L_t - N .. L_t - 1."""

    def __init__(self, cfg: ModelConfig, layers: int = 1):
        super().__init__()
        if not 1 <= layers <= cfg.layers:
            raise ValueError(f"a GliDe draft has 1..{cfg.layers} layers (the target's), got {layers}")
        self.cfg = cfg
        self.layers = nn.ModuleList(GlideLayer(cfg) for _ in range(layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.target_layers = [cfg.layers - layers + i for i in range(layers)]
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)
        self.rope_scale = rope_attention_scale(cfg)

    def forward(self, target, tokens, positions, target_kv, visible, cache=None) -> torch.Tensor:
        """Logits [b, n, vocab] of the draft at `tokens` [b, n] (positions [b, n]), through the
        target's embedding and LM head. target_kv: per draft layer, the target's (k, v) [b, kv, S, d]
        of its layer; visible [b, n]: the target slots each query may read. cache: the draft's own
        KVCache (decode: the tokens continue it), or None (training: the whole sequence)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        x = target.tok_embeddings(tokens)
        if cache is not None:
            cache.begin(tokens.shape[1], tokens.device)
        ok = False
        try:
            for i, layer in enumerate(self.layers):
                k, v = target_kv[i]
                x = layer(x, cos, sin, k, v, visible, None if cache is None else cache.layer(i))
            ok = True
        finally:
            if cache is not None:
                cache.end(ok)
        return F.linear(self.norm(x), target.lm_head_weight)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float | None = None) -> GlideDraft:
        gen = torch.Generator().manual_seed(seed)
        std = std if std is not None else self.cfg.init_std
        for p in self.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self
