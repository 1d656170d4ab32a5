"""Clover: a speculative draft with sequential knowledge, over the target's final hidden states.

Clover (Xiao et al. 2024, "Clover: Regressive Lightweight Speculative Decoding with Sequential
Knowledge") drafts from the target's last hidden states with three parts: a Regressive Connection
that carries the tokens already speculated, an Attention Decoder that joins them with the target's
hidden states, and an Augmenting Block that adapts those states to speculation. What follows is OUR
reading of it (the paper's facts; the shapes and the training below are longctx's own choices):

- Input: H [b, S, dim], the target's final-normed hidden states (what its LM head reads), frozen.
- Augmenting Block: one transformer block (causal self-attention with RoPE at the positions, per
  document under packing; a SwiGLU MLP of ffn_dim // 2) over H: A = Aug(H). It is the only part that
  sees the sequence by self-attention; at decode time it keeps a KV cache of its own over the
  positions it has processed (its prompt pass over the last `window` prompt tokens, then every
  verified token).
- Attention Decoder memory: keys and values projected from norm(A) (kv_heads x head_dim each, RoPE on
  the keys at their positions), one pair per verified position the Augmenting Block has processed.
- One draft step (regressive), from state s_{i-1} [dim] and token x_i (the pending token, then the
  previous proposal): u = W_r [norm(emb(x_i)); norm(s_{i-1})] (the Regressive Connection, 2 dim -> dim);
  a cross-attention with query Wq(norm(u)) (RoPE at x_i's position) over the memory, block-stale as
  GliDe's (models/glide.py: a position p sees memory positions below p // block * block: at decode
  time, what the last verification left), output projection Wo: s_i = u + Wo(attn); then
  s_i = s_i + MLP(norm(s_i)) (SwiGLU, ffn_dim // 4); logits = the target's LM head (or the reduced
  vocabulary's rows, models/draft_vocab.py) on final_norm(s_i).
- A round whose pending token sits at position b0 starts from s = A[b0 - 1], the augmented state of
  the last verified position (zeros at a document's first position).

Training (`chain_states`) is teacher-forced: the true tokens are the regressive inputs, and each
position's state is what the chain of its round computes, rounds starting at multiples of `block`
(document-relative). About as many parameters as a one-layer GliDe draft of the same target
(tests/unit/test_clover.py states both counts).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ModelConfig
from .draft_vocab import DraftVocab
from .glide import GlideDraft, block_stale_limit, cross_attention
from .llama import Block, RMSNorm, apply_rope, rope_attention_scale, rope_cos_sin, rope_inv_freq
from .swiglu import FeedForward


def shift_states(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [b, S, dim] moved one position later: out[:, t] = x[:, t - 1], zeros where a document starts
    (positions[:, t] == 0: no earlier position of that document)."""
    out = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    return torch.where((positions == 0)[..., None], torch.zeros_like(out), out)


class CloverDraft(nn.Module):
    """Augmenting Block, Attention Decoder memory, Regressive Connection and step MLP over a target of
    `cfg` (its dims). `vocab` > 0: a reduced vocabulary (as GlideDraft's)."""

    kind = "clover"

    def __init__(self, cfg: ModelConfig, vocab: int = 0):
        super().__init__()
        self.cfg = cfg
        dim, heads, kv, hd = cfg.dim, cfg.heads, cfg.kv_heads, cfg.resolved_head_dim
        # the Augmenting Block: a decoder block of the target's family with half its MLP
        self.aug = Block(dataclasses.replace(cfg, ffn_dim=max(1, cfg.ffn_dim // 2)))
        self.memory_norm = RMSNorm(dim, cfg.norm_eps)
        self.memory_k = nn.Linear(dim, kv * hd, bias=False)
        self.memory_v = nn.Linear(dim, kv * hd, bias=False)
        self.token_norm = RMSNorm(dim, cfg.norm_eps)
        self.state_norm = RMSNorm(dim, cfg.norm_eps)
        self.regressive = nn.Linear(2 * dim, dim, bias=False)
        self.query_norm = RMSNorm(dim, cfg.norm_eps)
        self.query = nn.Linear(dim, heads * hd, bias=False)
        self.out = nn.Linear(heads * hd, dim, bias=False)
        self.ffn_norm = RMSNorm(dim, cfg.norm_eps)
        self.feed_forward = FeedForward(dim, max(1, cfg.ffn_dim // 4))
        self.norm = RMSNorm(dim, cfg.norm_eps)
        self.heads, self.kv_heads, self.head_dim = heads, kv, hd
        self.target_layers: list[int] = []  # (GliDe's reads of target layers' K/V: Clover reads none)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)
        self.rope_scale = rope_attention_scale(cfg)
        self.vocab = DraftVocab(vocab) if vocab else None

    head_weight = GlideDraft.head_weight  # the target's LM head rows it scores (a reduced vocabulary's)
    logits = GlideDraft.logits            # final norm, those rows, back on the target's vocabulary

    @property
    def layers(self) -> list[nn.Module]:
        """The blocks that see the sequence (what metrics and bench decode count as layers)."""
        return [self.aug]

    def rope(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.inv_freq, self.rope_scale)

    def augment(self, hidden: torch.Tensor, positions: torch.Tensor, doc_ids=None) -> torch.Tensor:
        """A = Aug(H) [b, n, dim] over a whole sequence at `positions` [b, n] (causal per document of
        `doc_ids`)."""
        return self.aug(hidden, *self.rope(positions), doc_ids)

    def extend(self, hidden: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Decoding: verified positions' hidden states [b, n, dim] continue `cache` (a models/kv_cache.py
        KVCache of two layers: 0 the Augmenting Block's keys and values, 1 the Attention Decoder's
        memory); returns their A [b, n, dim]."""
        cos, sin = self.rope(positions)
        step = cache.begin(hidden.shape[1], hidden.device)
        ok = False
        try:
            out = self.aug(hidden, cos, sin, None, cache=cache.layer(0))
            k, v = self.memory(out, positions)
            cache.layer(1).append(k.transpose(1, 2), v.transpose(1, 2), step)
            ok = True
        finally:
            cache.end(ok)
        return out

    def memory(self, augmented: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Attention Decoder's keys (RoPE at `positions`) and values [b, kv_heads, n, head_dim]."""
        b, n, _ = augmented.shape
        x = self.memory_norm(augmented)
        cos, sin = self.rope(positions)
        k = apply_rope(self.memory_k(x).view(b, n, self.kv_heads, self.head_dim), cos, sin)
        v = self.memory_v(x).view(b, n, self.kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def step(self, prev: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, mem_k, mem_v,
             visible, *, key_pos=None, q_doc=None, k_doc=None) -> torch.Tensor:
        """One regressive step for every query [b, n]: the new states s [b, n, dim] from the previous
        states `prev` and the tokens' embeddings; the cross-attention reads the memory as
        models/glide.py cross_attention does (`visible`: an int reads that many first slots)."""
        u = self.regressive(torch.cat([self.token_norm(embedded), self.state_norm(prev)], dim=-1))
        b, n, _ = u.shape
        cos, sin = self.rope(positions)
        q = apply_rope(self.query(self.query_norm(u)).view(b, n, self.heads, self.head_dim), cos, sin)
        attn = cross_attention(q, mem_k, mem_v, visible, key_pos=key_pos, q_doc=q_doc, k_doc=k_doc)
        s = u + self.out(attn.flatten(2))
        return s + self.feed_forward(self.ffn_norm(s))

    def chain_states(self, target, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                     block: int, doc_ids=None) -> torch.Tensor:
        """Training's states [b, S, dim] (before the final norm), teacher-forced: the position p at
        document-relative offset j = p % block is step j + 1 of the round starting at p - j, which
        starts from A[p - j - 1]. Computed for every position at once, `block` times: pass i makes
        exact every position with j <= i (pass i's previous state for j > 0 is pass i - 1's, exact)."""
        augmented = self.augment(hidden, positions, doc_ids)
        mem_k, mem_v = self.memory(augmented, positions)
        embedded = target.tok_embeddings(tokens)
        start = shift_states(augmented, positions)      # A[p - 1] (zeros at a document's first position)
        first = (positions % block == 0)[..., None]     # where a round starts
        visible = block_stale_limit(positions, block)
        attend = dict(key_pos=positions, q_doc=doc_ids, k_doc=doc_ids)
        states = self.step(start, embedded, positions, mem_k, mem_v, visible, **attend)
        for _ in range(1, block):
            prev = torch.where(first, start, shift_states(states, positions))
            states = self.step(prev, embedded, positions, mem_k, mem_v, visible, **attend)
        return states

    def forward(self, target, tokens, positions, hidden, block: int, doc_ids=None) -> torch.Tensor:
        """Training's logits [b, S, vocab] (chain_states through the LM head)."""
        return self.logits(target, self.chain_states(target, tokens, positions, hidden, block, doc_ids))

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float | None = None) -> CloverDraft:
        gen = torch.Generator().manual_seed(seed)
        std = std if std is not None else self.cfg.init_std
        for name, p in self.named_parameters():  # (not the buffers: a reduced vocabulary's ids come from data)
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self
