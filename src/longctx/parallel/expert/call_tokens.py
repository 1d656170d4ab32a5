"""Every token of a micro-batch in one-device order, for the MoE decisions that look across tokens.

A capacity's drops and the Sinkhorn router's assignment are decided over every token of the
micro-batch, as one device holding all of it would (models/moe_capacity.py). Those tokens are spread
over the data-parallel rows and, within each row, over the head x ctx ranks in the zigzag or the
documents' layout (parallel/context/sequence.py), and expert parallelism is folded on the same ranks.
`MicroBatchTokens` is the layers' `call_tokens` hook (installed by parallelize() on every MoE layer,
one object for all of them, over the same ranks as the router statistics' sum): it all-gathers a
per-token value (the router's choices [T, k], or Sinkhorn's logits [T, E]) over those ranks, puts it
in one-device order, and takes this rank's part of a decision back.

Where each token goes comes from the block call: a forward pre-hook on every block that holds a MoE
layer (`watch`) notes the call's local shape [rows, seq_local] and its document ids, whose sequence
layout rides on them (shares.py attach_layout; without one, the zigzag layout, as the attention core
assumes). A token's place in the micro-batch is dp_rank x rows x seq + row x seq + position, the
order of one device's [rows x dp, seq] batch flattened (local_batch hands dp rank r the rows
[r x rows, (r + 1) x rows)). The places travel with the values (one more column of the choices; one
more small all-gather beside Sinkhorn's logits), so no rank needs the others' layouts. A recomputation
in backward that skips the block's hooks reads the places of the last call, the same micro-batch.

A block called with a KV cache (a decode step: every rank runs the same new tokens) routes its
tokens alone (`routes_alone`): nothing to gather.

Cost per MoE layer and call, for a capacity: an all-gather of T x (k + 1) int64 over the head x ctx
ranks of this data-parallel share (T tokens per rank) and of a [k, E] count matrix over the shares; the
decision runs on every rank over its share's tokens (a sort of k x T x head x ctx choices): nothing
grows with the data-parallel degree. With the Sinkhorn router: T x E fp32 and T int64 over every rank,
and its iterations on N x E (N = T x ranks) on every rank."""

from __future__ import annotations

import torch

from ...job import comm
from ..context.sequence import layout_of, shard_indices


class MicroBatchTokens:
    """The MoE layers' `call_tokens` over `group` (the ranks holding the micro-batch, flattened), given
    this rank's place in `mesh` (the 4-D mesh: dp_replicate, dp_shard, head, ctx)."""

    def __init__(self, mesh, group):
        self.mesh, self.group = mesh, group
        # a data-parallel share's ranks (its rows' sequences), and the shares (one rank each, in share order)
        self.share = comm.flattened(mesh["head", "ctx"], "moe_share")
        self.shares = comm.flattened(mesh["dp_replicate", "dp_shard"], "moe_shares")
        self._call = None  # (rows, seq_local, document ids or None, cached?) of the last block call
        self._places = None  # (key, [T] int64 places of this rank's tokens in the micro-batch, and in its share)

    def __repr__(self) -> str:
        return f"MicroBatchTokens(over {self.group.size()} ranks)"

    # ---- the block hook

    def watch(self, blocks) -> None:
        """Note every call of `blocks` (those holding MoE layers): its shape and documents, before it runs."""
        for block in blocks:
            block.register_forward_pre_hook(self._note, with_kwargs=True)

    def _note(self, block, args, kwargs) -> None:
        x = args[0] if args else kwargs["x"]
        doc_ids = args[3] if len(args) > 3 else kwargs.get("doc_ids")
        cache = args[4] if len(args) > 4 else kwargs.get("cache")
        self._call = (x.shape[0], x.shape[1], doc_ids, cache is not None)

    # ---- the CallTokens contract (models/moe_capacity.py)

    def routes_alone(self) -> bool:
        return self._call is not None and self._call[3]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return _gathered(local, self.places(local)[0], self.group)

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        return full[self._places[1][0]]

    def gather_share(self, local: torch.Tensor) -> torch.Tensor:
        places = self.places(local)[1]
        return local if self.share.size() == 1 else _gathered(local, places, self.share)

    def mine_share(self, share: torch.Tensor) -> torch.Tensor:
        return share if self.share.size() == 1 else share[self._places[1][1]]

    def share_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.shares.size() == 1:
            return counts[None], 0
        return comm.all_gather(counts, self.shares, label="moe_routing"), comm.local_rank(self.shares)

    # ---- where this rank's tokens lie in the micro-batch

    def places(self, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] int64 twice: the place of each token of this rank's call (its flat order) in the micro-batch,
        and in this rank's data-parallel share of it."""
        if self._call is None:
            raise RuntimeError("a MoE layer routed over the micro-batch outside a block call: MicroBatchTokens "
                               "learns the tokens' layout from the block's forward (watch)")
        rows, seq_local, doc_ids, _ = self._call
        layout = None if doc_ids is None else layout_of(doc_ids)
        key = (rows, seq_local, layout, local.device)  # (the layout by identity: a batch's own object)
        if self._places is None or any(a is not b and a != b for a, b in zip(self._places[0], key)):
            self._places = (key, tuple(p.to(local.device) for p in self._compute(rows, seq_local, layout)))
        if self._places[1][0].numel() != local.shape[0]:
            raise ValueError(f"a MoE layer's call holds {local.shape[0]} tokens, but its block was called with "
                             f"{rows} x {seq_local}: the routing over the micro-batch needs every token of the call")
        return self._places[1]

    def _compute(self, rows: int, seq_local: int, layout) -> tuple[torch.Tensor, torch.Tensor]:
        coord = lambda dim: comm.local_rank(comm.sub_mesh(self.mesh, dim))  # noqa: E731
        size = lambda dim: comm.sub_mesh(self.mesh, dim).size()  # noqa: E731
        c, h = size("ctx"), size("head")
        seq = seq_local * c * h
        if layout is not None:
            positions = layout.indices(coord("ctx"), coord("head"))
        elif c * h > 1:
            positions = shard_indices(seq, c, h, coord("ctx"), coord("head")).expand(rows, -1)
        else:
            positions = torch.arange(seq_local).expand(rows, -1)
        dp_rank = coord("dp_replicate") * size("dp_shard") + coord("dp_shard")
        in_share = (torch.arange(rows)[:, None] * seq + positions).flatten().long()
        return in_share + dp_rank * rows * seq, in_share


def _gathered(local: torch.Tensor, places: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `local` [T, ...] over `group`, each row put at its `places` (the same order on every rank)."""
    if not local.is_floating_point():  # the places ride along as one more column
        both = comm.all_gather(torch.cat([local.long(), places[:, None]], 1), group, label="moe_routing")
        both = both.flatten(0, 1)
        values, where = both[:, :-1].to(local.dtype), both[:, -1]
    else:
        values = comm.all_gather(local, group, label="moe_routing").flatten(0, 1)
        where = comm.all_gather(places, group, label="moe_routing").flatten()
    out = torch.empty_like(values)
    out[where] = values
    return out
