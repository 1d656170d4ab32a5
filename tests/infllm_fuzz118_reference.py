"""A float64 plain-PyTorch Llama written from docs/generate.md's words ("InfLLM context memory", "Ms-PoE") for
tests/unit/test_infllm_fuzz118.py: its own RoPE (HF's rotate-half convention, 1 / theta^(2i/d)), RMSNorm, SwiGLU
and softmax attention, reading only the weights of a longctx model.

InfLLM (docs/generate.md): a call (prefill chunk or decode token) of queries ending at `e` holds u =
(e - window - init) // block memory units, unit j covering slots [init + j block, init + (j + 1) block). A unit's
representatives are chosen in the call during which it forms: per kv head, its `repr` keys that the call's queries
(all their query heads) score highest, at real positions; rep = the sum of those keys unrotated (position 0).
The call's units: score = mean over queries of the sum over heads of q (turned to distance far = init + window +
block - 1) . rep, rounded to 2^-12 of the row's largest |score|, ties to the earlier unit, top `topk`. Each query
attends to the initial tokens, the chosen units and its local span [init + u block, itself], as one softmax:
shared, the far keys at position 0 and the query at `far`; ordered, laid end to end (initial at their slots, the
j-th chosen unit from init + j block, the query at init + k block + p - lo); the local span at real distances.

Ms-PoE: kv head g's positions (its keys' and its query heads') divided by its ratio; the ratios spaced linearly
over [min, max] by rank, the most position-aware (the highest share of probe attention weights above 3 x the
row's mean, over the probe's second half of queries, 512 tokens drawn with seed 0) first; index order: by index;
the first skip layers 1; one kv head: min."""

from __future__ import annotations

import math

import torch

GRID = 2.0 ** -12


def hf_rope(cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, factor on cos and sin) of llama3 or yarn RoPE scaling by transformers'
    ROPE_INIT_FUNCTIONS, from the config's fields as docs/running.md names them (not from the model)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type=cfg.rope_scaling, factor=cfg.rope_factor,
                   original_max_position_embeddings=cfg.rope_original_max_len)
    if cfg.rope_scaling == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    else:
        scaling.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
    hf = LlamaConfig(hidden_size=cfg.heads * head_dim, num_attention_heads=cfg.heads, head_dim=head_dim,
                     rope_theta=cfg.rope_theta, rope_scaling=scaling,
                     max_position_embeddings=int(cfg.rope_original_max_len * cfg.rope_factor))
    inv, factor = ROPE_INIT_FUNCTIONS[cfg.rope_scaling](hf, "cpu")
    return inv.double(), float(factor)


class Ref64:
    """The model's forward in float64. `ratios` [layers, kv] (Ms-PoE) or None."""

    def __init__(self, model, ratios=None):
        cfg = model.cfg
        self.cfg, self.hd = cfg, cfg.resolved_head_dim
        self.w = {k: v.detach().double().clone() for k, v in model.state_dict().items() if v is not None}
        self.inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        self.scale = 1.0  # YaRN's factor on cos and sin: 0.1 ln(factor) + 1
        if cfg.rope_scaling == "linear":
            self.inv = self.inv / cfg.rope_factor
        elif cfg.rope_scaling in ("llama3", "yarn"):  # (transformers' own frequencies and cos/sin factor)
            self.inv, self.scale = hf_rope(cfg, self.hd)
        elif cfg.rope_scaling != "none":
            raise ValueError(f"the reference has no rope_scaling {cfg.rope_scaling!r}")
        self.ratios = None if ratios is None else torch.as_tensor(ratios, dtype=torch.float64)

    def rope(self, x, pos):
        """x [..., d] turned by the angle of float positions `pos` (broadcast to x's leading dims)."""
        ang = torch.as_tensor(pos, dtype=torch.float64)[..., None] * self.inv
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        x1, x2 = x.chunk(2, dim=-1)
        return (x * cos + torch.cat([-x2, x1], -1) * sin) * self.scale

    def norm(self, x, name):
        return self.w[name] * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)

    def qkv(self, layer, x):
        """Unrotated q [b, n, heads, d], k, v [b, n, kv, d] of `layer` for hidden x [b, n, dim]."""
        p, (b, n, _) = f"layers.{layer}.attention.", x.shape
        h = self.norm(x, f"layers.{layer}.attention_norm.weight")
        q, k, v = (h @ self.w[p + f"w{x}.weight"].T + self.w.get(p + f"w{x}.bias", 0.0) for x in "qkv")
        q, k = q.view(b, n, self.cfg.heads, self.hd), k.view(b, n, self.cfg.kv_heads, self.hd)
        if self.cfg.qk_norm:  # (each head's vector: qk_norm_span head)
            q, k = self.norm(q, p + "q_norm.weight"), self.norm(k, p + "k_norm.weight")
        return q, k, v.view(b, n, self.cfg.kv_heads, self.hd)

    def post(self, layer, x, out):
        p = f"layers.{layer}."
        x = x + out.flatten(2) @ self.w[p + "attention.wo.weight"].T
        h = self.norm(x, p + "ffn_norm.weight")
        gate = torch.nn.functional.silu(h @ self.w[p + "feed_forward.w1.weight"].T)
        return x + (gate * (h @ self.w[p + "feed_forward.w3.weight"].T)) @ self.w[p + "feed_forward.w2.weight"].T

    def head(self, x):
        w = self.w.get("output.weight", self.w["tok_embeddings.weight"])
        return self.norm(x, "norm.weight") @ w.T

    def group(self, head):
        return head // (self.cfg.heads // self.cfg.kv_heads)

    def scaled(self, layer, head, pos):
        """Ms-PoE: a position of kv head `head`'s RoPE in `layer` (plain without ratios or in a skipped layer)."""
        return pos if self.ratios is None else pos / self.ratios[layer, head]

    def forward(self, tokens, probs_out=None):
        """Plain causal logits [b, s, vocab] (Ms-PoE's positions with ratios); `probs_out`: a list the attention
        weights [b, heads, s, s] of each layer are appended to (the probe's)."""
        x = self.w["tok_embeddings.weight"][torch.as_tensor(tokens)]
        s = x.shape[1]
        pos = torch.arange(s, dtype=torch.float64)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        for layer in range(self.cfg.layers):
            q, k, v = self.qkv(layer, x)
            out, probs = torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], s, s, dtype=torch.float64)
            for h in range(self.cfg.heads):
                g = self.group(h)
                qh = self.rope(q[:, :, h], self.scaled(layer, g, pos))
                kh = self.rope(k[:, :, g], self.scaled(layer, g, pos))
                logits = torch.einsum("bqd,bkd->bqk", qh, kh) / math.sqrt(self.hd)
                probs[:, h] = torch.softmax(logits.masked_fill(~causal, -math.inf), -1)
                out[:, :, h] = probs[:, h] @ v[:, :, g]
            if probs_out is not None:
                probs_out.append(probs)
            x = self.post(layer, x, out)
        return self.head(x)


class InfLLMRef:
    """Ref64 run call by call through InfLLM's memory as docs/generate.md says. `chosen[(layer, end)]`: each call's
    units (row 0); `keys_read`: the most keys one call's queries read (far + the call's local span)."""

    def __init__(self, model, shape, batch):
        self.m, self.s, self.b = Ref64(model), shape, batch
        self.far = shape.init + shape.window + shape.block - 1
        layers = model.cfg.layers
        self.k = [torch.zeros(batch, 0, model.cfg.kv_heads, self.m.hd, dtype=torch.float64) for _ in range(layers)]
        self.v = [t.clone() for t in self.k]
        self.reps = [{} for _ in range(layers)]  # unit -> [b, kv, d], unrotated sums
        self.chosen, self.keys_read, self.length = {}, 0, 0
        self.distance = 0  # the largest query position - key position any query saw

    def call(self, tokens):
        """Logits [b, n, vocab] of the call's tokens [b, n], appended after what the memory holds."""
        x = self.m.w["tok_embeddings.weight"][torch.as_tensor(tokens)]
        start, n = self.length, x.shape[1]
        for layer in range(self.m.cfg.layers):
            q, k, v = self.m.qkv(layer, x)
            self.k[layer], self.v[layer] = torch.cat([self.k[layer], k], 1), torch.cat([self.v[layer], v], 1)
            x = self.m.post(layer, x, self.attend(layer, q, start, start + n))
        self.length = start + n
        return self.m.head(x)

    def build(self, layer, q, qpos, units):
        """Representatives of the units forming in this call (the call's queries score their keys)."""
        s, m, K = self.s, self.m, self.k[layer]
        for u in range(units):
            if u in self.reps[layer]:
                continue
            slots = torch.arange(s.init + u * s.block, s.init + (u + 1) * s.block)
            rep = torch.zeros(self.b, m.cfg.kv_heads, m.hd, dtype=torch.float64)
            for g in range(m.cfg.kv_heads):
                heads = [h for h in range(m.cfg.heads) if m.group(h) == g]
                qs = sum(m.rope(q[:, :, h], qpos) for h in heads).sum(1)  # [b, d]: every query, every head
                kr = m.rope(K[:, slots, g], slots.double())  # [b, block, d]
                received = torch.einsum("bld,bd->bl", kr, qs)
                top = received.topk(s.repr, dim=1).indices  # [b, repr]
                rep[:, g] = K[:, slots, g].gather(1, top[..., None].expand(-1, -1, m.hd)).sum(1)
            self.reps[layer][u] = rep

    def select(self, layer, q, units):
        """[b] lists of the call's chosen units (ascending)."""
        m, out = self.m, []
        reps = torch.stack([self.reps[layer][u] for u in range(units)], 1)  # [b, u, kv, d]
        qf = m.rope(q, torch.tensor(float(self.far)))  # [b, n, heads, d]
        scores = sum(torch.einsum("bnd,bud->bnu", qf[:, :, h], reps[:, :, m.group(h)]) for h in range(m.cfg.heads))
        scores = scores.mean(1)  # [b, u]
        for r in range(self.b):
            step = scores[r].abs().max() * GRID
            snapped = torch.round(scores[r] / step) * step
            order = sorted(range(units), key=lambda u: (-snapped[u].item(), u))
            out.append(sorted(order[:self.s.topk]))
        return out

    def attend(self, layer, q, start, end):
        s, m = self.s, self.m
        K, V = self.k[layer], self.v[layer]
        qpos = torch.arange(start, end, dtype=torch.float64)
        init = min(s.init, end)
        units = max(0, (end - s.window - init) // s.block)
        out = torch.zeros_like(q)
        if units == 0:
            self.keys_read = max(self.keys_read, end)
        else:
            self.build(layer, q, qpos, units)
            chosen = self.select(layer, q, units)
            self.chosen[(layer, end)] = chosen[0]
            lo = init + units * s.block
            self.keys_read = max(self.keys_read, init + len(chosen[0]) * s.block + end - lo)
        for r in range(self.b):
            for i, p in enumerate(range(start, end)):
                if units == 0:
                    slots, kpos, qp_local, qp_far, nfar = list(range(p + 1)), list(range(p + 1)), p, p, 0
                else:
                    far = list(range(init)) + [init + u * s.block + o for u in chosen[r] for o in range(s.block)]
                    nfar = len(far)
                    if s.positions == "shared":
                        fpos, qp_far = [0] * nfar, self.far
                    else:
                        fpos, qp_far = list(range(nfar)), nfar + p - lo
                    slots, kpos, qp_local = far + list(range(lo, p + 1)), fpos + list(range(lo, p + 1)), p
                kp = torch.tensor(kpos, dtype=torch.float64)
                self.distance = max(self.distance, qp_far - min(kpos[:nfar], default=qp_far), qp_local - kpos[nfar])
                for h in range(m.cfg.heads):
                    g = m.group(h)
                    keys = m.rope(K[r, slots, g], kp)
                    logit_far = keys[:nfar] @ m.rope(q[r, i, h], torch.tensor(float(qp_far)))
                    logit_loc = keys[nfar:] @ m.rope(q[r, i, h], torch.tensor(float(qp_local)))
                    w = torch.softmax(torch.cat([logit_far, logit_loc]) / math.sqrt(m.hd), 0)
                    out[r, i, h] = w @ V[r, slots, g]
        return out


def spaced(order, low, high):
    """Ratios [n]: the k-th head of `order` (most position-aware first) gets low + (high - low) k / (n - 1)."""
    n = len(order)
    ratios = [0.0] * n
    for k, head in enumerate(order):
        ratios[head] = low if n == 1 else low + (high - low) * k / (n - 1)
    return ratios


def probe_scores(model):
    """[layers][kv] each kv head's share of probe attention weights over 3 x the row's mean (plain RoPE)."""
    cfg = model.cfg
    length = min(512, cfg.max_seq_len)
    tokens = torch.randint(cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    probs = []
    Ref64(model).forward(tokens, probs)
    group = cfg.heads // cfg.kv_heads
    out = []
    for p in probs:
        per_head = []
        for h in range(cfg.heads):
            rows = [(p[0, h, i, :i + 1] > 3.0 / (i + 1)).double().sum() / (i + 1) for i in range(length // 2, length)]
            per_head.append(torch.stack(rows).mean())
        out.append([sum(per_head[g * group:(g + 1) * group]) / group for g in range(cfg.kv_heads)])
    return out


def ms_poe_ratios(model):
    """[layers, kv] float64 ratios of docs/generate.md's Ms-PoE for `model`'s config."""
    cfg = model.cfg
    ratios = torch.ones(cfg.layers, cfg.kv_heads, dtype=torch.float64)
    scores = probe_scores(model) if cfg.rope_ms_poe_order == "attention" else None
    for layer in range(cfg.rope_ms_poe_skip_layers, cfg.layers):
        heads = list(range(cfg.kv_heads))
        if scores is not None:
            heads.sort(key=lambda g: -float(scores[layer][g]))  # (a stable sort: ties keep the index order)
        ratios[layer] = torch.tensor(spaced(heads, cfg.rope_ms_poe_min, cfg.rope_ms_poe_max), dtype=torch.float64)
    return ratios
