"""GliDe: a draft model whose layers read the target's KV cache (the draft half of GliDe with a CaPE).

Draft layer i of N: self-attention over the draft's own tokens (causal), then a cross-attention whose
query (RoPE at the token's position) attends to the target's cached keys and values of target layer
L_t - N + i, then a SwiGLU MLP. The cross-attention owns only a query and an output projection:
its keys and values are the target's, as cached (grouped like the target's: GQA). The draft has
no embedding or LM head of its own: it uses the target's (frozen), passed to `forward`. So it has
no long cache to fill at long context: the target's, which exists anyway, is what it reads.

Which of the target's positions a draft position sees is `visible` (per query: the key positions
below which it may read). At decode time that is what the target's cache holds: the prompt and
every accepted token, so every proposal of a round sees the cache as of the last verification.
Training sees the same thing, block-stale: position t sees the target's positions before the start
of its block of `block` tokens (block = the speculation length), t // block * block of them
(`block_stale_visible`); on packed documents t is the position within its document and only that
document's keys are seen (`block_stale_limit`, with key positions and document ids passed to
`cross_attention`). train/glide.py trains a draft so, against a frozen target. A verified token fed to
the draft late, with a round's pending one, reads as training reads its position, never its own or a
later slot (`decode_visible`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .draft_vocab import DraftVocab
from .kv_cache import group_queries, ungroup_heads
from .llama import Attention, RMSNorm, apply_rope, rope_attention_scale, rope_cos_sin, rope_inv_freq
from .shards import write_full
from .swiglu import FeedForward


def block_stale_visible(seq_len: int, block: int, device=None) -> torch.Tensor:
    """[seq_len]: how many target positions each position sees in training (its block's start)."""
    return torch.arange(seq_len, device=device) // block * block


def block_stale_limit(positions: torch.Tensor, block: int) -> torch.Tensor:
    """Per query at (document-relative) `positions`: the target keys of its document it sees are those
    at positions below this, the start of its block of `block` tokens."""
    return torch.div(positions, block, rounding_mode="floor") * block


def decode_visible(positions: torch.Tensor, slots: int, block: int) -> torch.Tensor:
    """Per draft query at `positions` fed at decode time, when the target's cache holds `slots` slots
    (positions 0..slots-1): the target positions below which it may read, as training reads them.
    A query at or past `slots` (the pending token and the round's proposals) reads every slot: the cache
    as the last verification left it, training's block-stale view with the round as the block. A query
    before `slots` is a verified token the draft is fed late (a fully kept round's last proposal, CaPE's
    kept alternative, adaptive K's plain steps, the prompt's last token): the target already holds its
    own slot and those after it, which training never shows that position, so it reads training's
    `block_stale_limit` of its position, as the drafter's prompt pass does."""
    return torch.where(positions < slots, block_stale_limit(positions, block), torch.full_like(positions, slots))


def masked_prefix_attention(k: torch.Tensor, v: torch.Tensor, slots: int, q: torch.Tensor,
                            visible: torch.Tensor) -> torch.Tensor:
    """prefix_attention with a limit per query: query i reads the slots below visible[:, i] (<= `slots`) of
    the first `slots` (a decode feed of several tokens: `decode_visible`). One masked kernel call and no
    host read; a query that sees no slot gets 0. Bound to a cache's k, v and slots it is a reader
    `read(q, visible)`, as GlideLayer takes one."""
    if slots <= 0:
        return torch.zeros_like(q)
    key_pos = torch.arange(slots, device=q.device)[None]
    return _masked_chunk(q, k[:, :, :slots], v[:, :, :slots], key_pos, visible, None, None)


_DOC_SHIFT = 32  # a key's sort code: document id << 32 | position (positions < 2^32)


def sequence_codes(doc, pos):
    """Sort codes of (document id, position) pairs: document id << 32 | position (position alone
    without documents); ascending in sequence order."""
    return pos.long() if doc is None else (doc.long() << _DOC_SHIFT) | pos.long()


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: int) -> torch.Tensor:
    """Every query attends to the first `slots` keys (k/v [b, kv_heads, S, d]; 0 slots: zeros). A draft
    step at decode time reads the target's cache so: every proposal of a round sees the slots the last
    verification left. No mask and no host read, which a draft step, a few hundred microseconds of
    small ops, would otherwise pay on each proposal."""
    if slots <= 0:
        return torch.zeros_like(q)
    out = F.scaled_dot_product_attention(group_queries(q, k.shape[1]), k[:, :, :slots], v[:, :, :slots])
    return ungroup_heads(out, q.shape[1], q.shape[2])


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | int,
                    chunk: int = 1024, *, key_pos: torch.Tensor | None = None, q_doc: torch.Tensor | None = None,
                    k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, n, heads, d] against the target's k/v [b, kv_heads, S, d] (GQA: query head h reads kv head
    h // (heads / kv_heads)). Query i of row r sees the keys j with key_pos[r, j] < visible[r, i]
    ([b, n]) and, with documents, k_doc[r, j] == q_doc[r, i]. key_pos [b, S] defaults to the slot
    index (a cache: `visible` is then how many slots a query reads; an int: every query reads that
    many, `prefix_attention`). A query that sees no key gets 0.

    The keys must be in sequence order (by document id, then position, as a sequence or a cache
    holds them; checked): a chunk of queries then sees one contiguous range of keys, found by binary
    search, and only that range is computed. Queries go `chunk` at a time, so a mask is
    [chunk, range] at most, never [n, S]; the ranges of every chunk are read to the host at once.
    Under autograd each chunk is checkpointed: the kernel would keep its fp32 additive mask [chunk x
    group, range] for backward, and over all chunks those are ~group x n x S / 2 floats (quadratic:
    4 GiB per layer and row at 32K tokens, 2 query heads per kv head, one document); backward rebuilds
    one chunk's at a time."""
    if isinstance(visible, int):
        if key_pos is not None or q_doc is not None or k_doc is not None:
            raise ValueError("cross_attention reads a prefix of slots (an int `visible`) without key positions "
                             "or documents")
        return prefix_attention(q, k, v, visible)
    b, n = q.shape[:2]
    S = k.shape[2]
    if (q_doc is None) != (k_doc is None):
        raise ValueError("cross_attention takes document ids for both the queries and the keys, or for neither")
    if key_pos is None:
        key_pos = torch.arange(S, device=q.device).expand(b, S)
    key_codes = sequence_codes(k_doc, key_pos).contiguous()
    # per query, the first key of its document and the first it may not see
    lo_all = torch.searchsorted(key_codes, sequence_codes(q_doc, torch.zeros_like(visible)).contiguous())  # [b, n]
    hi_all = torch.searchsorted(key_codes, sequence_codes(q_doc, visible).contiguous())
    starts = list(range(0, n, chunk))
    bounds = [torch.stack([lo_all[:, s:s + chunk].min(), hi_all[:, s:s + chunk].max()]) for s in starts]
    unsorted = (key_codes[:, 1:] < key_codes[:, :-1]).any().long()[None]
    plan = torch.cat([*bounds, unsorted]).tolist() if starts else [0]  # the one host read
    if plan[-1]:
        raise ValueError("cross_attention needs its keys in sequence order (document ids, then positions, "
                         "non-decreasing); sort them (and their positions and document ids) first")
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = []
    for c, s in enumerate(starts):
        lo, hi = plan[2 * c], plan[2 * c + 1]
        qc = q[:, s:s + chunk]
        if hi <= lo:
            outs.append(torch.zeros_like(qc))
            continue
        args = (qc, k[:, :, lo:hi], v[:, :, lo:hi], key_pos[:, lo:hi], visible[:, s:s + chunk],
                None if k_doc is None else k_doc[:, lo:hi], None if q_doc is None else q_doc[:, s:s + chunk])
        # (no randomness inside: nothing to save of the RNG for the recompute)
        outs.append(checkpoint(_masked_chunk, *args, use_reentrant=False, preserve_rng_state=False) if grad
                    else _masked_chunk(*args))
    return torch.cat(outs, dim=1) if outs else q.new_zeros(q.shape)


def _masked_chunk(qc, k, v, key_pos, visible, k_doc, q_doc):
    """cross_attention of one chunk of queries qc [b, m, heads, d] over the key range k/v [b, kv, keys, d]
    it can see: query i sees key j when key_pos[:, j] < visible[:, i] (and k_doc[:, j] == q_doc[:, i])."""
    b, m, heads, _ = qc.shape
    kv, keys = k.shape[1], k.shape[2]
    mask = key_pos[:, None, :] < visible[:, :, None]                                            # [b, m, keys]
    if q_doc is not None:
        mask &= k_doc[:, None, :] == q_doc[:, :, None]
    seen = mask.any(-1)                                                                         # [b, m]
    # a query that sees nothing attends to every key of the range (finite values and gradients)
    # and its output is zeroed below
    mask |= ~seen[..., None]
    mg = mask[:, None, :, None, :].expand(b, 1, m, heads // kv, keys).reshape(b, 1, m * (heads // kv), keys)
    out = ungroup_heads(F.scaled_dot_product_attention(group_queries(qc, kv), k, v, attn_mask=mg), m, heads)
    return torch.where(seen[:, :, None, None], out, torch.zeros_like(out))


class GlideLayer(nn.Module):
    """Self-attention, cross-attention to the target's K/V, MLP; in parts like a Block (models/llama.py),
    so memory policies (memory/apply_policy.py apply_glide_memory_policy) can treat them apart: `pre`,
    `mid` and `post` are token-wise; `self_attention.core` and the cross-attention are where tokens
    meet (and, sequence-parallel, `self_attention.core` is where ranks communicate)."""

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

    def pre(self, x, cos, sin):
        """self-attention norm, q/k/v projections, RoPE"""
        return self.self_attention.qkv(self.self_norm(x), cos, sin)

    def mid(self, x, attn, cos, sin):
        """self-attention output projection and residual; the cross-attention's query (RoPE on it)"""
        h = x + self.self_attention.wo(attn.flatten(2))
        b, n, _ = h.shape
        q = apply_rope(self.cross_q(self.cross_norm(h)).view(b, n, self.heads, self.head_dim), cos, sin)
        return h, q

    def post(self, h, cross):
        """cross-attention output projection, residual, MLP norm, MLP, residual"""
        h = h + self.cross_o(cross.flatten(2))
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x, cos, sin, target_k, target_v, visible, cache=None, doc_ids=None, key_pos=None,
                key_doc=None):
        """cache: this layer's models/kv_cache.py LayerCache for the draft's own keys (decode), or None
        (the whole sequence, causal within each document of `doc_ids`). The cross-attention's mask:
        cross_attention's `visible`, `key_pos`, and documents `doc_ids` (queries) / `key_doc` (keys)."""
        if cache is None:
            attn = self.self_attention.core(*self.pre(x, cos, sin), doc_ids)
        else:
            attn = cache.attend(*self.pre(x, cos, sin))
        h, q = self.mid(x, attn, cos, sin)
        if callable(target_k):  # a reader of the target's cache held elsewhere (sharded: read_attention)
            cross = target_k(q, visible)
        else:
            cross = cross_attention(q, target_k, target_v, visible, key_pos=key_pos, q_doc=doc_ids, k_doc=key_doc)
        return self.post(h, cross)


class GlideDraft(nn.Module):
    """N GliDe layers over a target of `cfg` (its dims), reading target layers L_t - N .. L_t - 1.
    `vocab` > 0: the draft proposes only that many tokens (models/draft_vocab.py; `vocab.ids` set by
    training from its data's counts, saved with the draft)."""

    def __init__(self, cfg: ModelConfig, layers: int = 1, vocab: int = 0):
        super().__init__()
        if not 1 <= layers <= cfg.layers:
            raise ValueError(f"a GliDe draft has 1..{cfg.layers} layers (the target's), got {layers}")
        self.cfg = cfg
        self.layers = nn.ModuleList(GlideLayer(cfg) for _ in range(layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.target_layers = [cfg.layers - layers + i for i in range(layers)]
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)
        self.rope_scale = rope_attention_scale(cfg)
        self.vocab = DraftVocab(vocab) if vocab else None

    def head_weight(self, target) -> torch.Tensor:
        """The LM head rows the draft scores: the target's, or those of its reduced vocabulary."""
        weight = target.lm_head_weight
        return weight if self.vocab is None else self.vocab.head(weight)

    def logits(self, target, x: torch.Tensor) -> torch.Tensor:
        """Logits [b, n, V] over the target's vocabulary from the last layer's output x (a reduced
        vocabulary's put back on it: -inf outside)."""
        out = F.linear(self.norm(x), self.head_weight(target))
        return out if self.vocab is None else self.vocab.full_logits(out, target.lm_head_weight.shape[0])

    def forward(self, target, tokens, positions, target_kv, visible, cache=None, *, doc_ids=None,
                key_positions=None, key_doc_ids=None) -> torch.Tensor:
        """Logits [b, n, vocab] of the draft at `tokens` [b, n] (positions [b, n]), through the
        target's embedding and LM head. target_kv: per draft layer, the target's (k, v) [b, kv, S, d]
        of its layer, or a reader `read(q, visible) -> out` of a cache held elsewhere (a target cache
        sharded over ranks: generate/sharded.py read_attention); visible [b, n]: per query, the
        key positions below which it may read the target (key_positions [b, S], default the slot
        index: decoding passes how many cache slots, an int when every query reads the same first slots:
        prefix_attention); with
        doc_ids [b, n] / key_doc_ids [b, S] only the keys of the query's document (training on packed
        documents, whose self-attention is then per document too). cache: the draft's own KVCache
        (decode: the tokens continue it), or None (training: the whole sequence)."""
        x = self.hidden_states(target, tokens, positions, target_kv, visible, cache, doc_ids=doc_ids,
                               key_positions=key_positions, key_doc_ids=key_doc_ids)
        return self.logits(target, x)

    def hidden_states(self, target, tokens, positions, target_kv, visible, cache=None, *, doc_ids=None,
                      key_positions=None, key_doc_ids=None, fill_only: bool = False) -> torch.Tensor | None:
        """The last layer's output [b, n, dim], before the final norm (forward's arguments). fill_only
        (with a cache): only fill the cache, return None: the last layer's keys and values are then all
        that is computed of it (a prompt pass, whose outputs nobody reads: for a 1-layer draft that
        skips the cross-attention over the whole window, most of the pass at a long prompt)."""
        if fill_only and cache is None:
            raise ValueError("fill_only fills a draft cache: pass one")
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        x = target.tok_embeddings(tokens)
        if cache is not None:
            cache.begin(tokens.shape[1], tokens.device)
        ok = False
        try:
            for i, layer in enumerate(self.layers):
                if fill_only and i == len(self.layers) - 1:
                    _, k, v = layer.pre(x, cos, sin)
                    cache.layer(i).append(k, v, cache.step)
                    x = None
                    break
                k, v = (target_kv[i], None) if callable(target_kv[i]) else target_kv[i]
                x = layer(x, cos, sin, k, v, visible, None if cache is None else cache.layer(i), doc_ids,
                          key_positions, key_doc_ids)
            ok = True
        finally:
            if cache is not None:
                cache.end(ok)
        return x

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float | None = None) -> GlideDraft:
        """Every parameter from `seed`, and the RoPE frequencies (after materialising from meta). A sharded
        parameter (after FSDP) gets its own slice of the full tensor one process draws, one parameter at a
        time, so every layout starts from the same draft and no rank holds the whole draft."""
        gen = torch.Generator().manual_seed(seed)
        std = std if std is not None else self.cfg.init_std
        for name, p in self.named_parameters():  # (not the buffers: a reduced vocabulary's ids are set from data)
            if name.endswith(".bias"):  # q/k/v/o biases (a Qwen2 or attention_bias target) start at 0, as the
                full = torch.zeros(p.shape)  # target's own init and Clover's do; 1 would shift every q, k, v
            elif p.dim() == 1:
                full = torch.ones(p.shape)
            else:
                full = torch.randn(p.shape, generator=gen) * std
            write_full(p, full)
        self.inv_freq.copy_(rope_inv_freq(self.cfg).float())
        return self
