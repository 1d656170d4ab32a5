"""The Sinkhorn router's assignment (S-BASE): Sinkhorn normalisation of the token x expert
affinities, then a balanced assignment of k distinct experts per token, every expert within one
choice of an even share. models/moe.py's SinkhornRouter calls both."""

from __future__ import annotations

import math

import torch


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """exp(logits) [T, E] scaled so that rows sum to 1 and columns to T / E (alternately, `iters`
    times), in log space for stability."""
    t, e = logits.shape
    if not t:  # (a call of no token: max() of nothing raises)
        return logits.float()
    log_p = logits.float() - logits.float().max()
    for _ in range(iters):
        log_p = log_p - log_p.logsumexp(0, keepdim=True) + math.log(t / e)  # columns: T / E each
        log_p = log_p - log_p.logsumexp(1, keepdim=True)                    # rows: 1 each
    return log_p


def balanced_assignment(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] scores -> [T, k] distinct experts per token, every expert taking floor or ceil of T k / E
    of the choices (an even share, to within one).

    Slot by slot, rounds of proposals: every token without an expert in the slot proposes to its
    best expert that it does not hold yet and that is not full (ceil(T k / E) choices); an expert
    accepts its best proposals up to its room. A token that finds every expert it does not hold full
    (the only room left is with experts it already holds) takes one by a swap: another token moves
    from that expert to one with room. Last, while an expert is below floor(T k / E), the cheapest
    move of one choice from a full expert fills it. Both moves always exist (a full expert has more
    holders than one with room, so one of its holders lacks the other), so the assignment always
    completes; ties go to the lower token and expert index (deterministic)."""
    state = _Assignment(scores, k)
    for slot in range(k):
        for s in sorted(state.propose(slot)):  # (rare) every expert s does not hold is full
            state.place_stuck(s, slot)
    state.even_out()
    return state.out


class _Assignment:
    """balanced_assignment's state: the choices so far, which experts each token holds, the loads."""

    def __init__(self, scores: torch.Tensor, k: int):
        t, e = scores.shape
        dev = scores.device
        self.scores, self.e = scores, e
        self.full_at, self.floor = -(-t * k // e), t * k // e
        self.out = torch.full((t, k), -1, dtype=torch.long, device=dev)
        self.held = torch.zeros(t, e, dtype=torch.bool, device=dev)  # the experts a token holds
        self.load = torch.zeros(e, dtype=torch.long, device=dev)
        self.experts = torch.arange(e, device=dev)

    def move(self, u: int, src: int, dst: int) -> None:
        """Token u's choice of expert src becomes dst."""
        self.out[u][self.out[u] == src] = dst
        self.held[u, src], self.held[u, dst] = False, True
        self.load[src] -= 1
        self.load[dst] += 1

    def propose(self, slot: int) -> list[int]:
        """Rounds of proposals for `slot`; returns the tokens that found every expert they lack full."""
        dev, scores, load = self.scores.device, self.scores, self.load
        todo, stuck = torch.arange(scores.shape[0], device=dev), []
        while todo.numel():
            masked = scores[todo].masked_fill(self.held[todo] | (load >= self.full_at), -math.inf)
            blocked = masked.isneginf().all(-1)
            stuck += todo[blocked].tolist()
            todo, masked = todo[~blocked], masked[~blocked]
            if not todo.numel():
                break
            want = masked.argmax(-1)
            pref = masked.gather(1, want[:, None]).squeeze(1)
            # per expert, rank the proposals by preference (best first; ties by token order)
            order = torch.argsort(pref, descending=True, stable=True)
            order = order[torch.argsort(want[order], stable=True)]
            w_sorted = want[order]
            first = torch.searchsorted(w_sorted, self.experts)
            rank = torch.arange(order.numel(), device=dev) - first[w_sorted]
            accepted = torch.zeros_like(want, dtype=torch.bool)
            accepted[order] = rank < (self.full_at - load)[w_sorted]
            took = todo[accepted]
            self.out[took, slot] = want[accepted]
            self.held[took, want[accepted]] = True
            load += torch.bincount(want[accepted], minlength=self.e)
            todo = todo[~accepted]  # rejected: that expert is full now, the next round skips it
        return stuck

    def place_stuck(self, s: int, slot: int) -> None:
        scores, held, load = self.scores, self.held, self.load
        free = ~held[s] & (load < self.full_at)
        if free.any():  # an earlier swap made room
            y = int(scores[s].masked_fill(~free, -math.inf).argmax())
        else:  # y: s's best expert; x: one with room (s holds it); u: holds y, not x; u moves y -> x
            y = int(scores[s].masked_fill(held[s], -math.inf).argmax())
            x = int(torch.nonzero(load < self.full_at)[0])
            gain = (scores[:, x] - scores[:, y]).masked_fill(~held[:, y] | held[:, x], -math.inf)
            self.move(int(gain.argmax()), y, x)
        self.out[s, slot] = y
        held[s, y] = True
        load[y] += 1

    def even_out(self) -> None:
        """While an expert x is below an even share: the cheapest move of one choice from a full expert."""
        scores, held, load = self.scores, self.held, self.load
        while self.floor < self.full_at and int(load.min()) < self.floor:
            x = int(load.argmin())
            gain = (scores[:, x:x + 1] - scores).masked_fill(~held | held[:, x:x + 1] | (load < self.full_at),
                                                             -math.inf)
            u, y = divmod(int(gain.argmax()), self.e)
            self.move(u, y, x)
