"""FlexMoE's dynamic expert placement: copies of hot experts on cool ranks of the expert group.

Under expert parallelism a rank runs the rows of the experts it owns (E / expert of them). When
routing is skewed, the rank that owns the hot experts receives several times the mean rows and the
whole group waits for it. FlexMoE moves part of a hot expert's rows to other ranks, which run a
copy of that expert.

Here every rank has `replicas` extra slots next to its own experts. A `Placement` (one per MoE
layer) says which expert each slot copies and what share of each expert's rows each of its holders
takes (the owner included; shares sum to 1). A sending rank cuts its rows of expert e by those
shares (cumulative rounding, so every row goes to exactly one holder), and the expert-parallel
dispatcher (parallel/expert/dispatch.py) exchanges the rows over slots instead of experts. A
layer's placement is its experts' `placement` attribute (None: the static one), which the
`ExpertPlacer` of the dispatcher sets.

A copy is not state: its weights are fetched from the owner in the layer's forward (one all-to-all
of the copied experts' weights, `_fetch_copies`), and the backward of that fetch sends the copy's
weight gradient back to the owner, where autograd adds it to the owner's own. So the parameters,
the optimizer and the checkpoints never see a placement (a checkpoint loads under any placement
or none), a copy can never drift from its expert, and a placement can change between any two
optimizer steps. The price is the copied experts' weights over the expert group's links, twice per
layer call (forward fetch, backward gradient; a call recomputed in backward fetches them once more),
and the layer is called for every micro-batch of a step (train.grad_accum), and for every piece of one a
memory policy runs the block in (memory.block_chunk's chunks, offload_fraction's two parts): the cost
bound below. The rank's rows arrive grouped by slot, its own experts' first, so they run as two grouped GEMMs
(`own_and_copy_experts`): the own experts on the parameters themselves, which the GEMMs save for backward at no
cost (as without copies), and the copy slots on the fetched weights (`copy_slot_weights`). In memory, a layer
call whose saved tensors are kept holds, until its backward, those copy slots (replicas x 3 x dim x expert_dim
values, what their GEMMs save, bf16 under autocast): memory/moe_counts.py copy_slot_bytes counts them for the
training-time prediction (the planner still refuses parallel.expert_replicas as uncosted). (Before 2026-12-05 one
GEMM ran the own experts and the copies joined into new tensors, which it saved, and the copies were put in their
slots by an index_copy, which kept the fetched weights too: (E / expert + replicas) x 3 x dim x expert_dim values
more per kept call in fp32.)

The policy (`plan_placement`) is a greedy water-filling over the loads seen over a window of steps
(the rows each expert ran: the router's choices less a capacity's drops, summed over every rank, the same on
all ranks, so every rank derives the same placement with no exchange):
  repeat: take the most loaded rank h and the least loaded rank c that can still take a copy (a
  free slot, or already holding the expert); move the largest of h's experts' rows that c can
  take, min(h's rows of it, h - mean, mean - c), from h to c; until max / mean <= 1 + tolerance,
  the slots run out, or a move would be smaller than `min_share` of the mean.
Cost bound: at most `replicas` copies per rank and layer, each 2 x 3 x dim x expert_dim values
over the links per layer call, against the rows it takes off the hot rank (each row 6 x dim x
expert_dim FLOPs there); the log line states both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from ...job import comm
from ...models.moe_experts import row_pieces, swiglu_experts


@dataclass(frozen=True)
class Placement:
    """Slots and shares of one MoE layer over an expert group of `ep` ranks, `local` experts owned by
    each (expert e on rank e // local) and `replicas` copy slots per rank.

    slot_expert[q]: the expert each slot of rank q runs (its own experts first, then its copies;
    -1 = an empty copy slot). holders[e]: (rank, slot, share) of every holder of e, owner first."""
    ep: int
    local: int
    replicas: int
    slot_expert: tuple[tuple[int, ...], ...]
    holders: tuple[tuple[tuple[int, int, float], ...], ...]
    predicted: dict = field(default_factory=dict, compare=False)

    @property
    def slots(self) -> int:
        return self.local + self.replicas

    @property
    def copies(self) -> int:
        return sum(e >= 0 for row in self.slot_expert for e in row[self.local:])

    @staticmethod
    def static(experts: int, ep: int, replicas: int = 0) -> Placement:
        local = experts // ep
        slots = tuple(tuple(range(q * local, (q + 1) * local)) + (-1,) * replicas for q in range(ep))
        holders = tuple(((e // local, e % local, 1.0),) for e in range(experts))
        return Placement(ep, local, replicas, slots, holders)

    def rank_shares(self) -> list[list[float]]:
        """[E][ep]: the share of each expert's rows that each rank of the group runs (its holders' shares
        on that rank; 1 on the owner under the static placement): what a rank's load is counted by."""
        shares = [[0.0] * self.ep for _ in self.holders]
        for e, holders in enumerate(self.holders):
            for q, _, share in holders:
                shares[e][q] += share
        return shares

    def slot_counts(self, counts: list[int]) -> list[int]:
        """counts[e] rows of each expert on this rank -> rows per (rank, slot), flat [ep x slots]:
        each expert's rows cut by its holders' shares, in holder order (cumulative rounding)."""
        out = [0] * (self.ep * self.slots)
        for e, n in enumerate(counts):
            for q, s, take in self._cut(e, n):
                out[q * self.slots + s] = take
        return out

    def _cut(self, e: int, n: int):
        done, cum = 0, 0.0
        for i, (q, s, share) in enumerate(self.holders[e]):
            cum += share
            upto = n if i == len(self.holders[e]) - 1 else min(n, int(n * cum + 0.5))
            yield q, s, upto - done
            done = upto

    def slot_order(self, counts: list[int]) -> torch.Tensor:
        """The permutation that lists rows grouped by expert (counts[e] each, in expert order) by
        (rank, slot) instead: x[order] is what the slot exchange sends."""
        starts, acc = [], 0
        for n in counts:
            starts.append(acc)
            acc += n
        segment = {}  # (rank, slot) -> (first row, rows)
        for e, n in enumerate(counts):
            first = starts[e]
            for q, s, take in self._cut(e, n):
                segment[(q, s)] = (first, take)
                first += take
        pieces = [torch.arange(a, a + n) for key in sorted(segment) for a, n in [segment[key]] if n]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)

    def fetches(self) -> list[tuple[int, int, int]]:
        """(rank, copy slot index, expert) of every filled copy slot, in (rank, slot) order."""
        return [(q, s - self.local, e) for q, row in enumerate(self.slot_expert)
                for s, e in enumerate(row) if s >= self.local and e >= 0]


def plan_placement(load, ep: int, replicas: int, tolerance: float = 0.05, min_share: float = 0.01) -> Placement:
    """The water-filling policy of the module docstring over load[e] (rows per expert over the
    window); returns the placement with its predicted max / mean rank load before and after."""
    load = [float(v) for v in load]
    experts = len(load)
    local = experts // ep
    mean = sum(load) / ep
    # rows[q][e]: the rows rank q would run of expert e; slot_of[q][e]: its slot
    rows = [{e: load[e] for e in range(q * local, (q + 1) * local)} for q in range(ep)]
    slot_of = [{e: e - q * local for e in range(q * local, (q + 1) * local)} for q in range(ep)]
    free = [replicas] * ep
    rank_load = [sum(r.values()) for r in rows]
    before = max(rank_load) / mean if mean else 1.0
    for _ in range(ep * (replicas + local) * 4):  # each move fills a rank or empties one's expert
        h = max(range(ep), key=lambda q: rank_load[q])
        if not mean or rank_load[h] <= mean * (1 + tolerance):
            break
        best = None
        for e, n in sorted(rows[h].items(), key=lambda kv: -kv[1]):
            takers = [q for q in range(ep) if q != h and rank_load[q] < mean and (e in slot_of[q] or free[q])]
            if not takers or n <= 0:
                continue
            c = min(takers, key=lambda q: (rank_load[q], e not in slot_of[q]))
            amount = min(n, rank_load[h] - mean, mean - rank_load[c])
            if best is None or amount > best[0]:
                best = (amount, e, c)
        if best is None or best[0] < min_share * mean:
            break
        amount, e, c = best
        if e not in slot_of[c]:
            slot_of[c][e] = local + replicas - free[c]
            free[c] -= 1
            rows[c][e] = 0.0
        rows[h][e] -= amount
        rows[c][e] += amount
        rank_load[h] -= amount
        rank_load[c] += amount
    slot_expert = []
    for q in range(ep):
        row = [-1] * (local + replicas)
        for e, s in slot_of[q].items():
            row[s] = e
        slot_expert.append(tuple(row))
    holders = []
    for e in range(experts):
        owner = e // local
        ranks = [owner] + sorted(q for q in range(ep) if q != owner and e in slot_of[q])
        total = load[e]
        holders.append(tuple((q, slot_of[q][e], (rows[q][e] / total) if total else float(q == owner))
                             for q in ranks))
    return Placement(ep, local, replicas, tuple(slot_expert), tuple(holders),
                     {"max_over_mean_before": before, "max_over_mean_after": max(rank_load) / mean if mean else 1.0})


def _fetch_copies(packed: torch.Tensor, placement: Placement, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights of the copies this rank receives [copies received, values] (w1, w3, w2 of an expert flattened
    side by side in `packed`'s rows), and for each of its copy slots the row of them it takes (int64 [replicas]; an
    empty slot: the row past them). Autograd ops only: the backward of the all-to-all returns each copy's gradient
    to its owner, where index_select's backward adds it to the owner's."""
    rank, local, ep = comm.local_rank(mesh), placement.local, placement.ep
    fetches = placement.fetches()
    # what this rank sends: to each rank in order, its own experts that rank copies (slot order)
    send = [(q, e - rank * local) for q, _, e in fetches if e // local == rank]
    mine = sorted((e // local, s) for q, s, e in fetches if q == rank)  # arrive owner-major, then by slot
    index = torch.tensor([i for _, i in send], dtype=torch.long, device=packed.device)
    got = comm.AllToAllV.apply(packed.index_select(0, index), mesh,
                               [sum(1 for q, _ in send if q == dest) for dest in range(ep)],
                               [sum(1 for o, _ in mine if o == src) for src in range(ep)], "expert_copies")
    row = {s: i for i, (_, s) in enumerate(mine)}
    slots = [row.get(s, len(mine)) for s in range(placement.replicas)]
    return got, torch.tensor(slots, dtype=torch.long, device=packed.device)


def copy_slot_weights(weights: tuple, placement: Placement, mesh) -> tuple:
    """The placement's copy slots of this rank, for the local expert weights (w1, w3, w2; [local, ...] each):
    [replicas, ...] each, in slot order (an empty slot zero), each its own contiguous tensor, as the grouped
    GEMM kernel wants its weights (ops/grouped.py)."""
    shapes = [w.shape[1:] for w in weights]
    packed = torch.cat([w.reshape(w.shape[0], -1) for w in weights], dim=1)
    got, slots = _fetch_copies(packed, placement, mesh)
    out, start = [], 0
    for shape in shapes:
        n = shape.numel()
        # a zero row for the empty slots, then each slot's row: index_select keeps only its index for backward
        # (index_copy into zeros would keep its source, the fetched weights, until backward)
        received = torch.cat([got[:, start:start + n], got.new_zeros(1, n)])
        out.append(received.index_select(0, slots).view(-1, *shape))
        start += n
    return tuple(out)


def own_and_copy_experts(rows: torch.Tensor, counts: torch.Tensor, weights: tuple, copies: tuple, own_rows: int,
                         chunk: int = 0) -> torch.Tensor:
    """The experts' SwiGLU on a rank's rows grouped by slot (counts[s] rows for slot s, in slot order: its own
    experts' rows first, `own_rows` of them, then its copy slots'): the own experts on `weights` (w1, w3, w2 as
    given: the parameters, which their grouped GEMMs save at no cost) and the copy slots on `copies`
    (copy_slot_weights), as two grouped GEMMs per projection. Both run even on zero rows: backward must reach the
    copies' fetch, an all-to-all every rank of the group joins. The same products as one GEMM over the slots.

    chunk > 0 (memory.expert_chunk): checkpointed pieces of at most `chunk` rows, cut over all the rows as
    swiglu_experts cuts them (models/moe_experts.py row_pieces: the same pieces and piece counts as one GEMM's),
    each split at the own rows it holds (known on the host)."""
    if not chunk or rows.shape[0] <= chunk:
        return _own_then_copies(rows, counts, own_rows, *weights, *copies)
    return torch.cat([checkpoint(_own_then_copies, rows[start:stop], piece_counts,
                                 min(max(own_rows - start, 0), stop - start), *weights, *copies, use_reentrant=False)
                      for start, stop, piece_counts in row_pieces(rows.shape[0], counts, chunk)])


def _own_then_copies(rows, counts, own_rows: int, w1, w3, w2, c1, c3, c2) -> torch.Tensor:
    local = w1.shape[0]
    return torch.cat([swiglu_experts(rows[:own_rows], counts[:local], w1, w3, w2),
                      swiglu_experts(rows[own_rows:], counts[local:], c1, c3, c2)])


class ExpertPlacer:
    """parallel.expert_replicas > 0: the router's counts of each optimizer step are summed (on the
    device) over a window of `window` steps; at its end every MoE layer gets the placement the
    policy derives from them (`layer.experts.placement`), used from the next step on (an
    optimizer-step boundary). The dispatcher's step_notes feed it after every step."""

    def __init__(self, layers, ep: int, replicas: int, window: int):
        self.layers, self.ep, self.replicas, self.window = layers, ep, replicas, max(1, window)
        self.seen: torch.Tensor | None = None
        self.steps = 0
        self.load: list[list[float]] | None = None  # the window the placements in use were planned from

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON): the window's steps and counts so far, and the load the placements
        in use came from; a resume plans them again for its own expert degree and copy slots."""
        return {"steps": self.steps, "seen": None if self.seen is None else self.seen.tolist(), "load": self.load}

    def load_state_dict(self, state: dict | None, device=None) -> None:
        """A checkpoint's state_dict (None: one written before placements were saved, the static start).
        Everything is replaced, placements included: a rollback restores a placer that may have re-placed
        since that checkpoint was saved. `device`: where the router counts `observe` adds are made (None: the
        first layer's w1's, which under memory.model_states = host is host memory: the window's counts there
        met the device's counts at the next step, which a GPU refuses)."""
        self.steps, self.seen, self.load = 0, None, None
        for layer in self.layers:
            layer.experts.placement = None
        if not state:
            return
        self.steps = int(state["steps"])
        device = self.layers[0].experts.w1.device if device is None else device
        self.seen = None if state["seen"] is None else torch.tensor(state["seen"], dtype=torch.float32,
                                                                   device=device)
        if state["load"] is not None:
            self._place(state["load"])

    def observe(self, counts: torch.Tensor) -> str | None:
        """counts [layers, E]: one step's rows per expert over every rank (its kept choices; the same on all ranks).
        Returns the log line on the steps that re-place."""
        counts = counts.detach()
        self.seen = counts if self.seen is None else self.seen + counts
        self.steps += 1
        if self.steps % self.window:
            return None
        load, self.seen = self.seen.tolist(), None  # the host read: once per window
        before, after, copies = self._place(load)
        w = self.layers[0].experts.w1
        # weights + their gradients, per forward and backward of every layer once: a step runs one per
        # micro-batch (train.grad_accum of them), each layer once per piece of a memory policy's block
        # (memory.block_chunk: 16 fetches for 2 where a micro-batch is 8 chunks), and a recomputed call fetches
        # the weights again (not counted here)
        moved = 2 * 3 * w.shape[1] * w.shape[2] * copies
        return (f"expert placement over the last {self.window} steps: {int(copies)} copies in {len(self.layers)} "
                f"layers; worst layer's max/mean rank load {before:.2f} -> {after:.2f} (predicted); the copies "
                f"move {moved / 1e6:.1f}M values per micro-batch (times the pieces a memory policy runs it in; "
                f"+half per recomputed forward)")

    def _place(self, load: list[list[float]]) -> tuple[float, float, int]:
        """Every layer's placement planned from its row of `load` [layers, E]; returns the worst layer's
        predicted max / mean rank load before and after, and the copies made."""
        self.load = load
        before = after = 0.0
        copies = 0
        for layer, row in zip(self.layers, load, strict=True):
            placement = plan_placement(row, self.ep, self.replicas)
            layer.experts.placement = placement
            before = max(before, placement.predicted["max_over_mean_before"])
            after = max(after, placement.predicted["max_over_mean_after"])
            copies += placement.copies
        return before, after, copies
