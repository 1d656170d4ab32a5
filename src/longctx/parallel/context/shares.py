"""A rank's share of a global batch under head x ctx: data-parallel rows, then its part of each sequence.

A rank's share is planned once (`plan_share`: the sequence layout of its rows and the global
positions it holds) and then taken either from a whole batch (`local_batch`) or read straight from a
memory-mapped store, only those positions (`read_local_batch`); both give the same tensors, bit for
bit. With one process (or head x ctx = 1) a share is the data-parallel rows, whole.
"""

from __future__ import annotations

import numpy as np
import torch

from ...data.samples import IGNORE, Batch
from ...data.sequence_weights import sequence_weights, weigh_sequences
from ...job import comm
from ...job.runtime import Runtime
from ...ops.segments import keep_host_copy
from .sequence import SequenceLayout, attach_layout, layout_of, plan_layout, shard_indices


def plan_share(rt: Runtime, doc_ids, rows: int, seq_len: int) -> tuple[SequenceLayout | None, torch.Tensor | None]:
    """How my part of each of my `rows` sequences is cut: the layout planned on the host from
    their document ids [rows, seq_len] (None without documents: zigzag), and the global
    positions I hold, LongTensor [rows, seq_len / (head x ctx)] in local order (None: all)."""
    if rt.mesh is None or rt.dims.head * rt.dims.ctx == 1:
        return None, None
    ctx_rank = comm.local_rank(comm.sub_mesh(rt.mesh, "ctx"))
    head_rank = comm.local_rank(comm.sub_mesh(rt.mesh, "head"))
    if doc_ids is not None:
        layout = plan_layout(doc_ids, rt.dims.ctx, rt.dims.head, balance=rt.seq_balance)
        return layout, layout.indices(ctx_rank, head_rank)
    return None, shard_indices(seq_len, rt.dims.ctx, rt.dims.head, ctx_rank, head_rank).expand(rows, -1)


def local_batch(rt: Runtime, batch: Batch, device=None) -> Batch:
    """My data-parallel share of a global batch, then my balanced part of each sequence (on
    `device` if given).

    With document ids the layout is `plan_layout(..., balance=parallel.seq_balance)`, planned here on
    the host from the ids every rank already has; the layout rides on the local document-id
    tensor to the attention core, so no rank ever asks the device where documents are."""
    if rt.mesh is None:
        return batch if device is None else batch.to(device)
    sl = rt.dp_rows(batch.tokens.shape[0])
    mine = Batch(*(None if t is None else t[sl] for t in (batch.tokens, batch.labels, batch.positions,
                                                         batch.doc_ids, batch.real, batch.label_weights)))
    layout, held = plan_share(rt, mine.doc_ids, mine.tokens.shape[0], mine.tokens.shape[1])
    take = lambda t: t if t is None or held is None else t.gather(1, held)  # noqa: E731
    local = Batch(take(mine.tokens), take(mine.labels), take(mine.positions), take(mine.doc_ids), take(mine.real),
                  take(mine.label_weights))
    if layout is not None:
        attach_layout(local.doc_ids, layout)
    return local if device is None else to_device(local, device)


def read_local_batch(rt: Runtime, samples, indices: list[int], loss_weighting: str = "token") -> tuple[Batch, int]:
    """My share of the global batch of samples `indices`, on the host (layout attached), and the loss's
    denominator over the whole global batch (the same on every rank): its valid labels, or with
    `loss_weighting` "sequence" (train.loss_weighting) its trained sequences, each label then weighted by
    1 / its sequence's labels (Batch.label_weights, from the rows whole: data/sequence_weights.py).

    A sample set that reads by position (a memory-mapped store, data/loader.py) reads its segment
    index for my rows, plans my share from it, and then reads only the tokens I hold, plus the next
    token of each one that has a label; its label count comes from the index too. Any other sample
    set (a synthetic mixture, a test's) is read whole and cut as `local_batch` cuts it."""
    by_sequence = loss_weighting == "sequence"
    if not getattr(samples, "reads_by_position", False):
        full = samples.batch(indices)
        if not by_sequence:
            return local_batch(rt, full), full.valid_tokens
        weights, count = weigh_sequences((full.labels != IGNORE).numpy(),
                                         None if full.doc_ids is None else full.doc_ids.numpy())
        full.label_weights = torch.from_numpy(weights)
        return local_batch(rt, full), count
    mine = list(indices)[rt.dp_rows(len(indices))]
    frames = samples.frames(mine)  # positions, document ids, labelled tokens: no token reads
    layout, held = plan_share(rt, frames.doc_ids, len(mine), samples.seq_len)
    local = samples.read_at(mine, frames, None if held is None else held.numpy())
    if by_sequence:
        weights = sequence_weights(frames.labelled, frames.doc_ids)  # (of the rows whole: then my positions)
        local.label_weights = torch.from_numpy(weights if held is None else
                                               np.take_along_axis(weights, held.numpy(), 1))
    if layout is not None:
        attach_layout(local.doc_ids, layout)
    return local, samples.sequence_count(indices) if by_sequence else samples.label_count(indices)


def to_device(local: Batch, device) -> Batch:
    """A local batch on `device`, its sequence layout (if any) still riding on the document ids."""
    layout = None if local.doc_ids is None else layout_of(local.doc_ids)
    moved = local.to(device)
    if layout is not None:
        attach_layout(moved.doc_ids, layout)
    elif local.doc_ids is not None:
        keep_host_copy(moved.doc_ids, local.doc_ids)
    return moved
