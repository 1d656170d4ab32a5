"""Activation memory policies, applied to a model's blocks without renaming any module.

A block is three parts (models/llama.py): `pre` (norm, q/k/v projections, RoPE) and `post`
(output projection, residuals, MLP) are token-wise and cheap; `attention.core` is the only place
tokens meet and, sequence-parallel, the only place ranks communicate. The policies:

- `none`: autograd keeps everything it saves.
- `full`: each block keeps only its input and recomputes itself in backward (attention included,
  with its communication).
- `selective` (LoongTrain's Selective Checkpoint++): `pre` and `post` are recomputed from the
  block input; the attention core keeps what its backward needs (q, k, v in its own layout, the
  output and the log-sum-exp), so backward never re-runs attention nor its all-to-all / ring.
- `selective` + `offload_fraction` A > 0 (MEMO's token-wise offload): in every block but the last
  `offload_skip_last`, the block input and the attention core's saved tensors (q, k, v, output,
  log-sum-exp) always go to the host, as in MEMO; of the other activations (norms, projections,
  MLP), the first A of the tokens store theirs on the host and the remaining tokens are recomputed
  in backward from the block input and attention output (brought back from the host). An
  offloaded block leaves nothing on the device; A trades host memory and transfer volume against
  recomputation. Its host parts come back while the next block's q/k/v projections run backward
  (memory/offload.py prefetch_mark, as under `full`), so no block's backward peak holds two blocks'.
- `full` + `offload_fraction` A > 0 (FPDT's choice): the one thing a block keeps, its input, goes
  to the host for the first A of its tokens. Host memory is then d elements per token and block,
  the least of any policy; the price is full recomputation. The input comes back while the next
  block's q/k/v projections run backward (after its attention core's backward: memory/offload.py
  prefetch_mark), so no block's backward peak holds two block inputs, and depth leaves the device
  peak as it is.
- `block_chunk` C > 0 (with full or selective): the token-wise parts run C tokens at a time and
  are checkpointed per chunk, so a block's MLP intermediates exist for C tokens, not for all of a
  rank's tokens (at 512K tokens per rank an 8B block's MLP alone is ~55 GiB in bf16). Pieces that
  are stored (selective + offload) under autocast over fp32 weights share one cast of each weight
  (memory/weight_casts.py), where each kept its own, and the recomputed pieces of the call reuse it in
  backward while the stored ones keep it, where each cast a second copy.

Token-splitting is exact because `pre` and `post` treat every token independently, with one
exception: MoE routing that looks across a call's tokens (a capacity, moe.capacity_factor > 0, drops
choices over an expert's share of the call; the Sinkhorn router balances its assignment over it). A
call in pieces routes such a layer as one call (`_PieceRouting`): a first pass over the pieces without
gradient computes each piece's router input (output projection, residual, norm, router: the experts
do not run, nothing is communicated), the routing is decided over all the call's tokens (under a layout,
with every other rank's tokens of the micro-batch: models/moe_capacity.py decide), and each
piece then runs (and is recomputed) with its slice of it, so only the experts' work is chunked.
The wrappers replace the block's bound `forward`, so parameter names (`layers.3.attention.wq.weight`)
stay the same for checkpoints and HF export.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config.rules import memory_policy_problems
from ..errors import ConfigError
from ..models.moe import moe_layers
from ..ops.eager import eager_under_compile
from .offload import HostOffloader
from .weight_casts import SharedCasts


def _checkpointed(fn, *args, block=None):
    """Non-reentrant checkpoint of fn(*args). `block`: the module fn runs in, when it may hold MoE
    layers: their routers record statistics in a training forward (models/moe.py), which saves
    tensors for the z-loss's backward; the recomputation must save the same tensors in the same
    order (non-reentrant checkpointing checks it), so it runs those recording ops again, with the
    flags the forward had, and drops what they record (the forward's records were the step's)."""
    layers = moe_layers(block) if block is not None else []
    if not layers:
        return checkpoint(fn, *args, use_reentrant=False)
    forward_flags: list[bool] = []

    def run(*a):
        if not forward_flags:  # the forward
            forward_flags.extend(layer.recording for layer in layers)
            return fn(*a)
        before = [(layer.recording, len(layer.records)) for layer in layers]
        for layer, flag in zip(layers, forward_flags):
            layer.recording = flag
        try:
            return fn(*a)
        finally:
            for layer, (flag, n) in zip(layers, before):
                layer.recording = flag
                del layer.records[n:]

    return checkpoint(run, *args, use_reentrant=False)


def _slices(tokens: int, chunk: int) -> list[slice]:
    """Token slices of at most `chunk` (0 = one slice of all tokens)."""
    if chunk <= 0 or tokens <= chunk:
        return [slice(0, tokens)]
    return [slice(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _one_row(t):
    """[b, s, ...] as [1, b x s, ...]: token-wise parts may see the batch as one row; then a chunk
    and "the first tokens" are contiguous slices (with batch > 1 a slice per row would be strided)."""
    return t if t.shape[0] == 1 else t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


class _PieceRouting:
    """A MoE layer's routing over every token of a block call that `_in_parts` runs in pieces, for a
    layer whose routing looks across tokens (MoEFeedForward.across_tokens). Installed as the layer's
    `pieces` while post runs: with no `piece` the layer only hands over its routing input (`gathered`);
    after `decide`, a piece's call (and its recomputation in backward) routes with its slice of the
    call's decisions (its experts, and the capacity's kept choices), held here in a few bytes
    per token until the block's backward."""

    def __init__(self, layer):
        self.layer, self.gathered, self.piece = layer, [], None
        self.chosen = self.kept = None

    def decide(self) -> None:
        chosen, self.kept = self.layer.decide(self.gathered)
        self.gathered = []
        small = torch.int16 if self.layer.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.chosen = None if chosen is None else chosen.to(small)

    @eager_under_compile  # (compiled `post`: the routing runs eagerly; no guard on the piece's state)
    def route(self, layer, flat):
        if self.piece is None:
            self.gathered.append(layer.routing_input(flat))
            return None
        sl = self.piece
        return layer.route(flat, None if self.chosen is None else self.chosen[sl].long(),
                           None if self.kept is None else self.kept[sl])


@contextlib.contextmanager
def _routing_pieces(routings: list[_PieceRouting], piece: slice | None):
    for r in routings:
        r.layer.pieces, r.piece = r, piece
    try:
        yield
    finally:
        for r in routings:
            r.layer.pieces = None


@contextlib.contextmanager
def _padding_pieces(layers, piece: slice):
    """Each MoE layer's padding mask (MoEFeedForward.real) cut to the piece being run, for its statistics."""
    for layer in layers:
        layer.piece = piece
    try:
        yield
    finally:
        for layer in layers:
            layer.piece = None


def _routed_post(block, routings: list[_PieceRouting], piece: slice):
    """block.post for the tokens `piece` of the call, routed with its slice of the call's routing (and of
    the call's padding mask)."""
    layers = moe_layers(block)
    if not layers:
        return block.post

    def post(x, attn):
        with _routing_pieces(routings, piece), _padding_pieces(layers, piece):
            return block.post(x, attn)
    return post


def _call_routing(block, xs, out, pieces) -> list[_PieceRouting]:
    """The routing over all the call's tokens of the block's MoE layers whose routing looks across
    tokens, from a first pass over the pieces without gradient (none with one piece: it is the call)."""
    routings = [_PieceRouting(m) for m in moe_layers(block) if m.across_tokens()] if len(pieces) > 1 else []
    if routings:
        with torch.no_grad(), _routing_pieces(routings, None):
            for xi, (sl, _) in zip(xs, pieces):
                block.post(xi, out[:, sl])
        for r in routings:
            r.decide()
    return routings


def _stored_pieces_casts(block, pieces, device_type: str) -> SharedCasts | None:
    """Where a block call stores a piece and runs another (selective + offload_fraction, with block_chunk or
    a fraction below 1) under autocast, the mode its pieces run in so that they keep one copy of each weight's
    cast between them, not one each (memory/weight_casts.py): the stored pieces share one, and a recomputed
    piece's checkpoint recasts inside it in backward, before the stored pieces' backward (they hold the
    earlier tokens), so it aliases that copy instead of making a second. Recomputed pieces alone keep no
    cast: each recasts in its own backward, one at a time. Weights already in autocast's dtype (FSDP's bf16
    gathers) are not cast: nothing to share. Compiled parts are left alone: under a dispatch mode their
    compiled code would not run, and the compiled graph decides what it saves."""
    stored = sum(not ckpt for _, ckpt in pieces)
    if (not stored or len(pieces) < 2 or not torch.is_autocast_enabled(device_type)
            or hasattr(block.post, "_torchdynamo_orig_callable")):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if all(p.dtype == dtype for p in block.parameters() if p.dim() >= 2):
        return None
    return SharedCasts(block.parameters())


def _inside(mode, fn):
    """fn run inside `mode` (a checkpointed piece: its forward, and its recomputation in backward)."""
    def run(*args):
        with mode:
            return fn(*args)
    return run


def _in_parts(block, x, cos, sin, doc_ids, *, chunk: int, recompute: bool, stored: int = 0, mark=None):
    """The block as pre -> attention core -> post, the token-wise parts run `chunk` tokens at a
    time (FPDT's sequence chunks; the batch counts as one row of b x s tokens): pre's and post's
    intermediates (above all the MLP's 4 x ffn_dim per token) then exist for one chunk at a time,
    in forward and, recomputed, in backward. The first `stored` tokens keep their intermediates
    (autograd saves them; under the offloader they go to the host); the others are checkpointed
    per chunk when `recompute`. A MoE layer whose routing looks across tokens routes the pieces as
    one call (`_call_routing`). `mark`: applied to (q, k, v) before the core (HostOffloader.prefetch_mark)."""
    b, tokens = x.shape[:2]
    n = b * tokens
    cut = min(stored, n)
    pieces = ([(sl, False) for sl in _slices(cut, chunk)]
              + [(slice(cut + sl.start, cut + sl.stop), recompute) for sl in _slices(n - cut, chunk)])
    pieces = [(sl, ckpt) for sl, ckpt in pieces if sl.stop > sl.start]
    x1, cos1, sin1 = _one_row(x), _one_row(cos), _one_row(sin)
    # one x slice object per piece, passed to pre and to post: the offloader copies it once. Views made by
    # one split (the pieces cover the tokens in order): their backward is one concatenation of the pieces'
    # gradients, where a slice each made its gradient full size (zeros elsewhere) and added it to the sum so
    # far: per piece two full-size [tokens, dim] tensors written and one read (at 512K tokens and 64 pieces
    # ~4 TiB of memory traffic per 8B block), and three full-size gradients alive at once
    sizes = [sl.stop - sl.start for sl, _ in pieces]
    xs = list(x1.split(sizes, dim=1))
    casts = _stored_pieces_casts(block, pieces, x.device.type)

    def run(fn, ckpt, *args):
        if casts is not None:
            fn = _inside(casts, fn)
        return _checkpointed(fn, *args, block=block) if ckpt else fn(*args)

    qkv = [run(block.pre, ckpt, xi, cos1[:, sl], sin1[:, sl]) for xi, (sl, ckpt) in zip(xs, pieces)]
    batched = lambda t: t if b == 1 else t.view(b, tokens, *t.shape[2:])
    q, k, v = (batched(_cat(parts)) for parts in zip(*qkv))
    if mark is not None:
        q, k, v = mark(q, k, v)
    out = _one_row(block.attention.core(q, k, v, doc_ids))
    routings = _call_routing(block, xs, out, pieces)
    posts = [_routed_post(block, routings, sl) for sl, _ in pieces]
    outs = out.split(sizes, dim=1)  # (as xs)
    y = batched(_cat([run(post, ckpt, xi, oi) for post, xi, oi, (_, ckpt) in zip(posts, xs, outs, pieces)]))
    if casts is not None:  # (from here on the stored pieces' saved casts alone keep the shared copies)
        casts.release()
    # a block must not return a view: FSDP2 hooks its output, and an in-place op on a view would
    # bypass that hook (FSDP warns); one copy of the block output is cheap next to the MLP
    return y.clone() if y._is_view() else y


def _marked_forward(block, mark, x, cos, sin, doc_ids):
    """Block.forward (without a cache), with `mark` applied to q, k, v before the attention core."""
    return block.post(x, block.attention.core(*mark(*block.pre(x, cos, sin)), doc_ids))


def _full_forward(x, cos, sin, doc_ids, *, block, chunk: int, offloader: HostOffloader | None = None,
                  index: int = 0, fraction: float = 0.0, mark=None):
    """Checkpoint the whole block; with chunk > 0 its recompute runs the token-wise parts in
    checkpointed chunks too. With the offloader, the only thing kept, the block input, goes to the
    host: its first `fraction` of tokens (the rest stays on the device). `mark` (the offloader's
    prefetch_mark of the block before, when that one is offloaded): applied to q, k, v, it brings the
    block before back once this block's attention core has run backward."""
    if chunk:
        fn = functools.partial(_in_parts, block, chunk=chunk, recompute=True, mark=mark)
    elif mark is not None:
        fn = functools.partial(_marked_forward, block, mark)
    else:
        fn = functools.partial(type(block).forward, block)
    if offloader is None:
        return _checkpointed(fn, x, cos, sin, doc_ids, block=block)
    # the offloader splits a saved tensor by storage elements: for [b, s, dim] the first tokens
    with offloader.block(index, shared=(cos, sin, doc_ids)), offloader.offload(fraction):
        return _checkpointed(fn, x, cos, sin, doc_ids, block=block)


def _selective_forward(x, cos, sin, doc_ids, *, block, chunk: int, mark=None):
    """`mark` (the offloader's prefetch_mark of the block before, when that one is offloaded): as in
    _full_forward, applied to q, k, v before the attention core."""
    if not chunk:
        q, k, v = _checkpointed(block.pre, x, cos, sin)
        if mark is not None:
            q, k, v = mark(q, k, v)
        return _checkpointed(block.post, x, block.attention.core(q, k, v, doc_ids), block=block)
    return _in_parts(block, x, cos, sin, doc_ids, chunk=chunk, recompute=True, mark=mark)


def _offload_forward(x, cos, sin, doc_ids, *, block, offloader: HostOffloader, index: int, fraction: float,
                     chunk: int, mark=None):
    # Everything saved in here goes to the host, including what the checkpoints of the recomputed
    # tokens keep (their inputs: the block input and the attention output), so the block leaves
    # nothing on the device; `fraction` only decides which tokens' other activations are stored
    # (host) rather than recomputed. `mark`: as in _selective_forward.
    with offloader.block(index, shared=(cos, sin, doc_ids)), offloader.offload(1.0):
        return _in_parts(block, x, cos, sin, doc_ids, chunk=chunk, recompute=True,
                         stored=round(fraction * x.shape[0] * x.shape[1]), mark=mark)


def check_policy(recompute: str, offload_fraction: float, block_chunk: int = 0) -> None:
    problems = memory_policy_problems(recompute, offload_fraction, block_chunk)
    if problems:
        raise ConfigError(" ".join(problems))


def apply_memory_policy(layers: nn.ModuleList, recompute: str, offload_fraction: float = 0.0,
                        offload_skip_last: int = 1, device="cpu", block_chunk: int = 0) -> HostOffloader | None:
    """Wrap every block's forward for the policy; returns the offloader when anything is offloaded.
    block_chunk: tokens per chunk of the token-wise parts (0 = all of a rank's tokens at once)."""
    check_policy(recompute, offload_fraction, block_chunk)
    if recompute == "none":
        return None
    # an offloaded block comes back from the next block's q/k/v backward on (its prefetch_mark), not
    # from that block's first unpack (memory/offload.py: what the device peak holds), under full and
    # selective recomputation alike
    offloader = HostOffloader(torch.device(device), prefetch_on_unpack=False) if offload_fraction > 0 else None
    offloaded = len(layers) - offload_skip_last
    for i, block in enumerate(layers):
        off = dict(offloader=offloader, index=i, fraction=offload_fraction) if offloader and i < offloaded else {}
        # (the first kept block too: the offloaded one before it comes back in its backward)
        mark = offloader.prefetch_mark(i - 1) if offloader and 0 < i <= offloaded else None
        if recompute == "full":
            forward = functools.partial(_full_forward, block=block, chunk=block_chunk, mark=mark, **off)
        elif off:
            forward = functools.partial(_offload_forward, block=block, chunk=block_chunk, mark=mark, **off)
        else:
            forward = functools.partial(_selective_forward, block=block, chunk=block_chunk, mark=mark)
        block.forward = forward
    return offloader


def _glide_selective_forward(x, cos, sin, target_k, target_v, visible, cache=None, doc_ids=None, key_pos=None,
                             key_doc=None, *, layer):
    from ..models.glide import cross_attention

    if cache is not None:  # (decoding runs without gradients: nothing to recompute)
        return type(layer).forward(layer, x, cos, sin, target_k, target_v, visible, cache, doc_ids, key_pos, key_doc)
    q, k, v = _checkpointed(layer.pre, x, cos, sin)
    attn = layer.self_attention.core(q, k, v, doc_ids)
    h, cross_q = _checkpointed(layer.mid, x, attn, cos, sin)
    cross = cross_attention(cross_q, target_k, target_v, visible, key_pos=key_pos, q_doc=doc_ids, k_doc=key_doc)
    return _checkpointed(layer.post, h, cross)


def apply_glide_memory_policy(layers: nn.ModuleList, recompute: str) -> None:
    """The policies for GliDe draft layers (models/glide.py GlideLayer): `full` checkpoints each
    layer (its self-attention recomputed in backward, with its communication); `selective` recomputes
    the token-wise parts (`pre`, `mid`, `post`) and keeps the self-attention core's saved state, as for
    a Block; the cross-attention keeps its inputs and recomputes each query chunk's masked kernel in
    backward under every policy (models/glide.py cross_attention: its masks are quadratic). Offload and
    block chunks are not offered for draft layers (config/rules.py refuses them)."""
    check_policy(recompute, 0.0)
    for layer in layers:
        if recompute == "full":
            layer.forward = functools.partial(_checkpointed, functools.partial(type(layer).forward, layer))
        elif recompute == "selective":
            layer.forward = functools.partial(_glide_selective_forward, layer=layer)
