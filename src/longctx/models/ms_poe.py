"""Ms-PoE, multi-scale positional encoding (Zhang et al. 2024, "Found in the Middle: How Language
Models Use Long Contexts Better via Plug-and-Play Positional Encoding"): a training-free position
option for generation and evaluation (model.rope_ms_poe).

Each attention head's RoPE positions are divided by its own ratio r >= 1, so a head reads the prompt
compressed by r (like linear interpolation, but per head). Compressing the positions weakens RoPE's
long-term decay, which is what the paper blames for facts in the middle of a prompt being missed;
keeping ratios spread over [rope_ms_poe_min, rope_ms_poe_max] (the paper: 1.2 to 1.8) keeps some heads
close to the positions the weights learned. All positions stay inside the trained window: it extends
nothing (config/positions.py's reach is unchanged).

Our choices, where the paper leaves room:
- The ratio belongs to a kv head: its keys are rotated once (and cached rotated), so its query heads
  share it, and q.k always sees (p_q - p_k) / r, in a full forward and in cached decode alike. With
  one kv head (multi-query attention) every head gets rope_ms_poe_min.
- The first rope_ms_poe_skip_layers layers keep plain RoPE (the paper keeps the first 2).
- Order (rope_ms_poe_order): `attention` ranks a layer's kv heads by how position-aware they are and
  spaces the ratios linearly over that rank, the most position-aware getting rope_ms_poe_min. The paper
  measures this on each input; we measure it once, at load, on a fixed probe (PROBE_TOKENS tokens drawn
  from the vocabulary with seed PROBE_SEED, the model with plain RoPE), so a model's positions never
  depend on its prompt, a prefill in chunks equals a prefill in one piece, and the same weights always
  get the same ratios. A head's score is the share of its attention weights over `OUTLIER` times the
  row's mean (1 / the keys the query sees), for the probe's second half of queries: a head that
  singles out positions has many; a kv head scores its query heads' mean. Ties keep the index order.
  `index` spaces the ratios by kv head index (no probe).
The probe needs the whole weights on the process (a one-process eval, or generate, whose ranks each
hold the weights); a model sharded by FSDP refuses `attention` with an error naming `index`.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

PROBE_TOKENS = 512  # probe length (or model.max_seq_len, if shorter)
PROBE_SEED = 0
OUTLIER = 3.0       # a weight over OUTLIER x the row's mean counts as an outlier


def spaced_ratios(order: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """[n] fp32 ratios of n kv heads, `order` naming them from the most position-aware to the least:
    the k-th gets low + (high - low) k / (n - 1); one head gets `low`."""
    n = order.numel()
    steps = torch.linspace(low, high, n, dtype=torch.float64) if n > 1 else torch.tensor([low], dtype=torch.float64)
    ratios = torch.empty(n, dtype=torch.float64)
    ratios[order] = steps
    return ratios.float()


def head_ratios(model, cos_sin) -> torch.Tensor:
    """[layers, kv_heads] fp32 ratios of `model` (a models.llama.Llama), per its config: 1 in the skipped
    layers. `cos_sin(positions)` gives plain RoPE tables (the probe's)."""
    cfg = model.cfg
    ratios = torch.ones(cfg.layers, cfg.kv_heads)
    if cfg.rope_ms_poe_order == "index":
        order = torch.arange(cfg.kv_heads)
        ranked = [order] * cfg.layers
    else:
        scores = probe_scores(model, cos_sin)
        ranked = [torch.sort(-s, stable=True).indices for s in scores]  # most position-aware first
    for layer in range(cfg.rope_ms_poe_skip_layers, cfg.layers):
        ratios[layer] = spaced_ratios(ranked[layer], cfg.rope_ms_poe_min, cfg.rope_ms_poe_max)
    return ratios.to(model.inv_freq.device)


@torch.no_grad()
def probe_scores(model, cos_sin) -> torch.Tensor:
    """[layers, kv_heads] position-awareness of each kv head on the fixed probe (module docstring),
    the model running with plain RoPE and its attention written out in fp32."""
    _refuse_sharded(model)
    cfg, device = model.cfg, model.inv_freq.device
    length = min(PROBE_TOKENS, probe_positions(cfg))
    tokens = torch.randint(cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(PROBE_SEED))
    positions = torch.arange(length, device=device)[None]
    cos, sin = cos_sin(positions)
    x = model.tok_embeddings(tokens.to(device))
    rows = torch.arange(length // 2, length, device=device)  # queries that see at least half the probe
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    scores = []
    for block in model.layers:
        q, k, v = block.pre(x, cos, sin)
        group = q.shape[2] // k.shape[2]
        kk, vv = (t.float().repeat_interleave(group, dim=2) for t in (k, v))
        logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) / q.shape[-1] ** 0.5
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # [1, heads, s, s]
        seen = (rows + 1).float()[:, None]  # keys each probed query sees
        outliers = (probs[0][:, rows] > OUTLIER / seen).float().sum(-1) / seen[:, 0]  # [heads, rows]
        scores.append(outliers.mean(-1).view(k.shape[2], group).mean(-1).cpu())
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vv)
        x = block.post(x, out.to(x.dtype))
    return torch.stack(scores)


def probe_positions(cfg) -> int:
    """The positions the probe may use: those the weights trained on (config/positions.py), not model.max_seq_len,
    which a run raises at will (eval sets it to its longest --lengths): the ratios, and so every score, would then
    depend on the other lengths a run evaluates. Without init_from (a library model), its max_seq_len."""
    if not cfg.init_from:
        return cfg.max_seq_len
    from ..config.positions import trained_positions

    return trained_positions(cfg.init_from).positions


def _refuse_sharded(model) -> None:
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError("model.rope_ms_poe_order=attention measures each head on a probe with the whole weights, "
                          "but this model is sharded (FSDP: an eval on several processes, or memory.model_states="
                          "host). Set --model.rope_ms_poe_order=index, or evaluate on one process (--nproc 1), or "
                          "use --mode generate, whose ranks each hold the weights.")


def ms_poe_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, ratios: torch.Tensor, scale: float = 1.0):
    """cos, sin [batch, seq, kv_heads, head_dim] fp32: kv head g's integer positions [batch, seq]
    divided by ratios[g], times `scale` (YaRN's attention factor; 1 otherwise). A ratio of 1 gives
    exactly models.llama.rope_cos_sin's values (the same float operations)."""
    scaled = positions.float()[..., None] / ratios.float()  # [b, s, kv]
    freqs = scaled[..., None] * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale
