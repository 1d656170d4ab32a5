"""Scoring sequences with a model under any 2D layout: forward only, the chunked LM head per token.

The model is built the way training builds it (meta -> parallelise -> each rank fills its own
shards from the checkpoint), so a length that needs several ranks evaluates on several ranks.
Each rank scores its tokens of its rows (`local_batch`, parallel/context/shares.py: data-parallel rows, then the
head x ctx part of each sequence) and adds them into job-wide tensors that one all-reduce sums:
per position bucket (ppl) and per sequence (retrieval). Every token is counted exactly once, so
the figures are the same under every layout up to the order of float additions.
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.samples import IGNORE, Batch
from ..job.runtime import Runtime
from ..parallel.context.shares import local_batch
from ..progress import LayerCounts
from .tasks import Sequence


def _batches(seqs: list[Sequence], batch: int):
    """Groups of `batch` sequences; the last group is filled up with unscored copies."""
    for start in range(0, len(seqs), batch):
        group = seqs[start:start + batch]
        real = len(group)
        group = group + [Sequence(group[0].tokens, np.full(group[0].length, IGNORE), group[0].length)] * (batch - real)
        tokens = torch.stack([torch.from_numpy(s.tokens) for s in group]).long()
        labels = torch.stack([torch.from_numpy(s.labels) for s in group]).long()
        positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
        yield start, real, Batch(tokens, labels, positions, None)


@torch.no_grad()
def score(model, rt: Runtime, seqs: list[Sequence], batch: int, buckets: int, device: torch.device,
          autocast_dtype, progress=None) -> dict:
    """{"nll_sum", "tokens"} per position bucket [buckets] and {"nll", "misses", "scored"} per
    sequence [len(seqs)], summed over the whole job (float64, on the host). `progress` (a progress.Phase, or
    None) counts the sequences scored, a long one layer by layer (progress.LayerCounts)."""
    # (one part per layer and one for the LM head and loss: a long sequence is minutes of one forward, and counted
    # only when it was done its time left grew until then)
    within = LayerCounts(getattr(model, "layers", None) if progress is not None else None, progress, extra_parts=1)
    try:
        return _score(model, rt, seqs, batch, buckets, device, autocast_dtype, within)
    finally:  # (the hooks off the model, also after an error)
        within.close()


def _score(model, rt: Runtime, seqs: list[Sequence], batch: int, buckets: int, device: torch.device,
           autocast_dtype, within: LayerCounts) -> dict:
    length = seqs[0].length
    per_bucket = torch.zeros(2, buckets, dtype=torch.float64, device=device)    # nll sum, tokens
    per_seq = torch.zeros(3, len(seqs), dtype=torch.float64, device=device)     # nll, misses, scored
    rows = batch // rt.dp
    for start, real, global_batch in _batches(seqs, batch):
        within.begin(real)
        local = local_batch(rt, global_batch, device)
        # (uncached: the weights' bf16 copies would otherwise live until the forward's end: step/loss.py)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None, cache_enabled=False):
            scores = model(local.tokens, local.positions, local.doc_ids, labels=local.labels,
                           loss_reduction="tokens").double()
        valid = (local.labels != IGNORE).double()
        nll, hit = scores[..., 0], scores[..., 1]
        bucket = (local.positions * buckets // length).clamp(max=buckets - 1)
        per_bucket[0].index_add_(0, bucket.flatten(), nll.flatten())
        per_bucket[1].index_add_(0, bucket.flatten(), valid.flatten())
        first = start + rt.dp_rank * rows  # this rank's rows of the global batch
        keep = max(0, min(rows, start + real - first))  # the filler rows are not sequences
        if keep:
            per_seq[:, first:first + keep] += torch.stack([nll.sum(1), (valid - hit).sum(1), valid.sum(1)])[:, :keep]
        within.end()
    per_bucket, per_seq = rt.sum_tensor(per_bucket).cpu(), rt.sum_tensor(per_seq).cpu()
    return {"nll_sum": per_bucket[0].tolist(), "tokens": per_bucket[1].tolist(), "nll": per_seq[0].tolist(),
            "misses": per_seq[1].tolist(), "scored": per_seq[2].tolist()}
