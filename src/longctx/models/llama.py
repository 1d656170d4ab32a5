"""Llama-architecture decoder for one device. It knows nothing about parallelism (see parallel/).

RMSNorm, rotary position embeddings (RoPE: default, linear, Llama-3 and YaRN frequency scaling),
grouped-query attention through ops/attention.py, SwiGLU MLP or a Mixture of Experts (models/moe.py,
[model.moe]), tied or untied embeddings. The families that differ from Llama only in small ways are
switches of the same model: optional biases on q/k/v (Qwen2) or q/k/v/o (attention_bias), q/k
RMSNorm before RoPE (per head: Qwen3; over the whole projection: OLMoE), an explicit head_dim
(Mistral, Qwen3).

Module names are stable and layout independent (`layers.3.attention.wq`), so checkpoints and the
Hugging Face mapping never depend on how the model is parallelised. RoPE uses the "rotate half"
convention of Hugging Face checkpoints, so their q/k weights load without permutation.

Build with `build_model(cfg, device)`: the modules are created on the meta device and only then
materialised and initialised, so `build_model(cfg, "meta")` gives an 8B or 70B shape for
planning without allocating any memory. A training run builds on meta, shards (parallel/), and only
then materialises: `init_weights` writes each rank's shard of exactly the values one process would
hold (models/shards.py), so no rank ever holds the whole model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..config.positions import ms_poe_problems, refuse_ms_poe_in_training
from ..errors import ConfigError
from ..ops.attention import attention
from ..ops.loss import lm_head_loss, lm_head_token_scores
from ..ops.norm import rms_norm
from .moe import MoEFeedForward, RouterTerms, moe_layers, router_terms, update_expert_bias
from .ms_poe import head_ratios, ms_poe_cos_sin
from .shards import write_full
from .swiglu import FeedForward


def _yarn_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """YaRN (NTK-by-parts): dimensions that turn many times within the original context keep their
    frequency (extrapolation), those that turn less than once are interpolated by `factor`, and a
    linear ramp joins them. Written in the same float operations as transformers, so logits agree."""
    hd, base, factor = cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_factor
    original = cfg.rope_original_max_len

    def correction_dim(rotations):  # the dimension that turns `rotations` times over the original context
        return (hd * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, hd, 2).to(device=device, dtype=torch.float) / hd)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_scale(cfg: ModelConfig) -> float:
    """YaRN's factor on cos and sin (so on q.k, squared): 1 for every other RoPE type."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return float(mscale(cfg.rope_factor, cfg.rope_mscale) / mscale(cfg.rope_factor, cfg.rope_mscale_all_dim))
    return mscale(cfg.rope_factor)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim / 2], with the configured scaling."""
    hd = cfg.resolved_head_dim
    if cfg.rope_scaling == "yarn":
        return _yarn_inv_freq(cfg, device)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    if cfg.rope_scaling == "linear":
        inv = inv / cfg.rope_factor  # positions divided by factor
    if cfg.rope_scaling == "llama3":
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, and the band
        # between the two wavelength thresholds interpolated smoothly (Llama 3.1 recipe).
        old = cfg.rope_original_max_len
        low_wavelen = old / cfg.rope_low_freq_factor
        high_wavelen = old / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        smooth = (old / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        mid = (1 - smooth) * inv / cfg.rope_factor + smooth * inv
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """cos, sin [batch, seq, 1, head_dim] in fp32 for integer positions [batch, seq], times `scale`
    (YaRN's attention factor; 1 otherwise)."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions [batch, seq] that restart at 0 at every change of document id along a row (data/loader.py's
    rule), for a forward given doc_ids without positions: what each document's own forward would use. RoPE sees
    only differences, but fp32 angles lose precision with their size, so 0..seq-1 over a long packed row scored
    its later documents off their own forwards (3e-4 at offset 8,000)."""
    index = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the angles of cos and sin, in at least fp32, the result in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    # bf16 x times fp32 cos promotes inside the multiply: the same values and gradients as x.float() * cos,
    # without fp32 copies of x and of its rotation in every forward of q and k (twice a step under recompute
    # full), ~0.2 us a token of llama3-1b's step on an H200 by benchmarks/step_roofline.py. The tables come
    # in fp32; fp64 x now rotates in fp64 (x.float() had rounded an fp64 reference to fp32)
    acc = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    return (x * cos.to(acc) + rotated * sin.to(acc)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention. `self.core` is the attention kernel; parallelize() swaps it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.resolved_head_dim
        self.wq = nn.Linear(cfg.dim, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.heads * self.head_dim, cfg.dim, bias=cfg.out_bias)
        # RMSNorm on q and k before RoPE: over each head's vector (Qwen3, qk_norm_span = head) or over
        # the whole projection, every head together (OLMoE, qk_norm_span = all)
        self.qk_norm_all = cfg.qk_norm_span == "all"
        q_size, k_size = (self.heads * self.head_dim, self.kv_heads * self.head_dim) if self.qk_norm_all \
            else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_size, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_size, cfg.norm_eps) if cfg.qk_norm else None
        self.core = local_attention

    def qkv(self, x, cos, sin):
        """Projections and RoPE: token-wise (no token sees another), so any token slice can be
        recomputed on its own."""
        b, s, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.q_norm is not None and self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k in v's dtype, the projections' compute dtype: under bf16 autocast the q/k norms' fp32 weights
        # make them fp32 (rms_norm: x's dtype times weight's), and the kernels take one dtype (a ring's
        # stack([k, v]) promoted v instead: attention silently in fp32), as SDPA under autocast casts them
        if cos.shape[-2] == 1:  # one table for every head: plain RoPE
            return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v
        # Ms-PoE (models/ms_poe.py): a table per kv head, shared by its query heads (heads kv * g .. kv * g + g - 1)
        g = self.heads // self.kv_heads
        q = apply_rope(q.view(b, s, self.kv_heads, g, self.head_dim), cos[..., None, :], sin[..., None, :])
        return q.view(b, s, self.heads, self.head_dim).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v

    def forward(self, x, cos, sin, doc_ids):
        out = self.core(*self.qkv(x, cos, sin), doc_ids)
        return self.wo(out.flatten(2))


def local_attention(q, k, v, doc_ids):
    out, _ = attention(q, k, v, causal=True, q_doc=doc_ids, k_doc=doc_ids)
    return out


class Block(nn.Module):
    """One decoder layer as three parts, so memory policies (memory/apply_policy.py) can treat them
    differently: `pre` and `post` are token-wise and cheap to recompute; `attention.core` is the
    only place tokens meet (and, sequence-parallel, the only place ranks communicate)."""

    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # a Mixture of Experts (models/moe.py) in the layers [model.moe] makes sparse
        self.feed_forward = MoEFeedForward(cfg) if moe else FeedForward(cfg.dim, cfg.ffn_dim)

    def pre(self, x, cos, sin):
        """attention norm, q/k/v projections, RoPE -> q, k, v [b, s, heads or kv_heads, head_dim]"""
        return self.attention.qkv(self.attention_norm(x), cos, sin)

    def post(self, x, attn):
        """output projection, residual, MLP norm, MLP, residual -> the block's output"""
        h = x + self.attention.wo(attn.flatten(2))
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x, cos, sin, doc_ids, cache=None):
        """With `cache` (a models/kv_cache.py LayerCache) the new tokens' keys and values are appended
        to it and their queries attend to everything it holds; without, `attention.core` runs."""
        if cache is None:
            return self.post(x, self.attention.core(*self.pre(x, cos, sin), doc_ids))
        return self.post(x, cache.attend(*self.pre(x, cos, sin)))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if ms_poe_problems(cfg):  # (config validation says it first; a model built from a bare ModelConfig here)
            raise ConfigError(" ".join(ms_poe_problems(cfg)))
        self.cfg = cfg
        # model.padding_idx: the row torch's embedding backward leaves without gradient (transformers' pad_token_id)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, cfg.padding_idx if cfg.padding_idx >= 0 else None)
        sparse = set(cfg.moe_layer_ids)
        self.layers = nn.ModuleList(Block(cfg, moe=i in sparse) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.empty(cfg.resolved_head_dim // 2), persistent=False)
        self.rope_scale = rope_attention_scale(cfg)
        # Ms-PoE's ratio per layer and kv head (models/ms_poe.py); None when off (one RoPE table for all)
        self.register_buffer("ms_poe_ratios", torch.empty(cfg.layers, cfg.kv_heads) if cfg.rope_ms_poe else None,
                             persistent=False)
        # tokens per chunk of the LM head + loss (ops/loss.py); 0 = one [tokens, vocab] logits tensor
        self.loss_chunk = 0
        # MoE: sums a tensor over every rank holding tokens of the micro-batch (the router statistics);
        # None = this process holds them all. parallelize() sets it.
        self.router_sum = None
        # True once parallelize() splits each row over sequence-parallel ranks (a zigzag or document share
        # each): a forward must then be given each token's positions (arange over the share is not them)
        self.split_sequence = False

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_rope(self, ms_poe_ratios: torch.Tensor | None = None):
        """Set the non-persistent RoPE frequencies (after materialising from meta) and, with Ms-PoE,
        each kv head's ratio (its `attention` order measures the weights as they are now: call after
        loading them; `ms_poe_ratios`: ratios measured before, e.g. on the fp32 weights before a cast)."""
        self.inv_freq.data = rope_inv_freq(self.cfg, device=self.inv_freq.device).float()
        if self.ms_poe_ratios is not None:
            self.ms_poe_ratios = ms_poe_ratios.float() if ms_poe_ratios is not None else \
                head_ratios(self, lambda p: rope_cos_sin(p, self.inv_freq, self.rope_scale))

    def layer_rope(self, index: int, positions: torch.Tensor, plain: tuple) -> tuple:
        """(cos, sin) of layer `index` at `positions`: `plain` (rope_cos_sin's, shared by every layer),
        or Ms-PoE's per-kv-head tables in the layers it applies to."""
        if self.ms_poe_ratios is None or index < self.cfg.rope_ms_poe_skip_layers:
            return plain
        return ms_poe_cos_sin(positions, self.inv_freq, self.ms_poe_ratios[index], self.rope_scale)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Initialise every parameter and buffer in place (after materialising from meta).

        A sharded parameter (after FSDP) gets its own slice of the full tensor one process would
        draw, one parameter at a time, so every layout starts from the same weights; the transient
        is the largest single parameter, never the model."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.inv_freq.device).manual_seed(seed)
        std = self.cfg.init_std
        # Output projections of each residual branch are scaled down with depth (GPT-2 / Llama practice).
        out_std = std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            full = torch.empty(p.shape, dtype=p.dtype, device=self.inv_freq.device)
            if name.endswith(".bias"):
                nn.init.zeros_(full)
            elif p.dim() == 1:
                nn.init.ones_(full)
            else:
                s = out_std if name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")) else std
                nn.init.normal_(full, mean=0.0, std=s, generator=gen)
            if name == "tok_embeddings.weight" and self.cfg.padding_idx >= 0:  # (as nn.Embedding and transformers
                full[self.cfg.padding_idx] = 0.0  # initialise it: a row no gradient moves starts at zero)
            write_full(p, full)
        for layer in moe_layers(self):
            layer.router.expert_bias.zero_()
        self.init_rope()

    def hidden_states(self, tokens, positions=None, doc_ids=None, final_norm: bool = True, cache=None, real=None):
        """The last block's output, through the final norm unless final_norm=False. Positions not given: 0..seq-1,
        restarting at each document of `doc_ids` (document_positions). With `cache` (a
        models/kv_cache.py KVCache) the tokens continue each row of the cache: their positions follow
        what the row holds (unless given), and their keys and values are appended to it. `real` [batch, seq]
        bool (the loader's Batch.real; None: every token): False at padding, which MoE layers leave out of
        their statistics and capacity queues (models/moe_stats.py, moe_capacity.py)."""
        b, s = tokens.shape
        flat_real = None if real is None or cache is not None else real.reshape(-1).bool()
        for layer in moe_layers(self):  # (kept after the forward: backward's recomputation routes as it did)
            layer.real = flat_real
        if cache is not None:
            return self._cached_hidden_states(tokens, positions, doc_ids, final_norm, cache)
        if positions is None:
            if self.split_sequence:
                raise ValueError("this model's rows are split over sequence-parallel ranks (each holds a zigzag or "
                                 "document share of a row): pass each token's positions (the loader's Batch."
                                 "positions); 0..n-1 over a share would rotate its tokens by the wrong angles")
            positions = torch.arange(s, device=tokens.device).expand(b, s) if doc_ids is None \
                else document_positions(doc_ids)
        if self.ms_poe_ratios is not None and self.training and torch.is_grad_enabled():
            refuse_ms_poe_in_training(self.cfg)  # (a library caller's training forward; longctx train refuses earlier)
        rope = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        x = self.tok_embeddings(tokens)
        moe = moe_layers(self)
        # routers record their statistics in a training forward only: not in evaluation, and not
        # when backward recomputes a block (that happens after this forward has returned)
        for layer in moe:
            layer.records.clear()
            layer.recording = self.training and torch.is_grad_enabled()
        try:
            for i, layer in enumerate(self.layers):
                x = layer(x, *self.layer_rope(i, positions, rope), doc_ids)
        finally:
            for layer in moe:
                layer.recording = False
        return self.norm(x) if final_norm else x

    def _cached_hidden_states(self, tokens, positions, doc_ids, final_norm, cache):
        if doc_ids is not None:
            raise ValueError("a KV cache holds one document per row; pass no doc_ids with cache=")
        if tokens.shape[0] != cache.batch:
            raise ValueError(f"tokens have {tokens.shape[0]} rows but the cache {cache.batch}")
        step = cache.begin(tokens.shape[1], tokens.device)
        ok = False
        try:
            if positions is None:
                positions = step.positions
            # a compiled static-shape step (models/static_decode.py) installed on the cache takes the
            # calls it handles (decode steps, verifications); the per-layer path is the reference
            fast = getattr(cache, "fast", None)
            if fast is not None and fast.handles(cache, step):
                x = fast(self, tokens, positions, cache, step, final_norm)
            else:
                rope = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
                x = self.tok_embeddings(tokens)
                # (MoE routers record statistics only in a training forward; their flag stays off here)
                for i, layer in enumerate(self.layers):
                    x = layer(x, *self.layer_rope(i, positions, rope), None, cache=cache.layer(i))
                x = self.norm(x) if final_norm else x
            ok = True
        finally:
            cache.end(ok)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed hidden states [..., dim] -> [..., vocab]."""
        return F.linear(hidden, self.lm_head_weight)

    # ------------------------------------------------------------------------------------------
    # Mixture of Experts: the training loop's side of the routers

    def set_router_step(self, step: int) -> None:
        """The optimizer step about to run (0-based): schedules such as DTS-Gate's read it."""
        for layer in moe_layers(self):
            layer.router.step = step

    def router_terms(self) -> RouterTerms | None:
        """The balancing losses and load figures of the last training forward (None for a dense
        model): this rank's share of the weighted loss, to add to its loss before backward."""
        moe = moe_layers(self)
        if not moe or not moe[0].records:
            return None
        return router_terms(moe, self.cfg.moe_aux_loss, self.cfg.moe_z_loss, self.router_sum)

    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """After an optimizer step: the aux-loss-free bias moves toward an even load (moe.bias_update_rate)."""
        if self.cfg.moe_bias_update_rate > 0:
            update_expert_bias(moe_layers(self), counts, self.cfg.moe_bias_update_rate)

    def forward(self, tokens, positions=None, doc_ids=None, labels=None, loss_reduction="mean", cache=None,
                hidden: bool = False, real=None, label_weights=None, scored=None):
        """Logits [batch, seq, vocab] without labels (with `hidden=True` the final-normed hidden states
        [batch, seq, dim] instead, for a caller that applies the LM head itself, in chunks: GliDe's
        distillation, train/glide.py); with labels (-100 = ignore) the cross-entropy,
        averaged over valid tokens (`loss_reduction="mean"`) or summed (`"sum"`, for callers that
        normalise over a larger batch); `"tokens"` (evaluation, no gradient): per token [batch, seq, 2],
        the label's negative log-likelihood and whether it is the greedy choice (ops/loss.py).
        With `cache` (models/kv_cache.py) the tokens continue the cached rows (see hidden_states); `real`:
        which tokens are not padding (see hidden_states); `label_weights` [batch, seq]: each label's weight in
        the sum or mean (train.loss_weighting = sequence; ignored by "tokens"); `scored`: the flat index of the
        labels scored (ops/loss.py scored_rows, made on the host), so the LM head runs over those rows only
        (ignored by "tokens", which finds its own)."""
        if labels is None:
            h = self.hidden_states(tokens, positions, doc_ids, cache=cache, real=real)
            return h if hidden else F.linear(h, self.lm_head_weight)
        # the final norm runs inside the loss, chunk by chunk when the loss is chunked: at long
        # context its fp32 statistics would otherwise be the largest tensor left outside the blocks
        x = self.hidden_states(tokens, positions, doc_ids, final_norm=False, cache=cache, real=real)
        norm = (self.norm.weight, self.norm.eps)
        if loss_reduction == "tokens":
            scores = lm_head_token_scores(x.flatten(0, 1), self.lm_head_weight, labels.flatten(),
                                          chunk=self.loss_chunk, norm=norm)
            return scores.view(*labels.shape, 2)
        return lm_head_loss(x.flatten(0, 1), self.lm_head_weight, labels.flatten(), chunk=self.loss_chunk,
                            reduction=loss_reduction, norm=norm, rows=scored,
                            label_weights=None if label_weights is None else label_weights.flatten())


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = 0) -> Llama:
    """Create on meta, then (unless device is meta) materialise on `device` and initialise."""
    with torch.device("meta"):
        model = Llama(cfg)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and isinstance(model, Llama):
        n -= model.tok_embeddings.weight.numel()
    return n
