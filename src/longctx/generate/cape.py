"""CaPE (confidence-aware proposal expansion), verified as a tree: greedy speculative decoding.

Per draft step i the draft's top choice d_i continues the chain; its probability (the draft's
confidence) picks, from a table of confidence bins, how many alternatives (the next most likely
tokens at that step) are added beside it. Where the draft is sure it adds none; where it hesitates
it hedges. The candidates form a tree: the pending token at the root, the chain d_1..d_K down its
spine, each step's alternatives as leaves beside d_i. The target verifies every node in one cached
call: a node attends to the cache and to its ancestors and itself (the tree mask), at the position
of its depth. Acceptance walks from the root: while a child of the current node is the target's
greedy choice after it, that child is kept; the target's choice after the last kept node is the
next pending token. So the output is plain greedy decoding, token for token.

The cache keeps the root and the accepted path (`keep`: on one device they move to consecutive
slots, since an alternative sits after the chain's nodes in the call; sharded, each rank keeps the
ones it holds) and forgets the other nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .sampling import Sampling, check_chosen, greedy_choice

DEFAULT_TABLE = "0.3:3,0.6:2,0.9:1,1:0"


@dataclass(frozen=True)
class CapeTable:
    """Confidence bins: (upper bound, alternatives), ascending; a confidence c falls in the first bin
    whose bound is >= c. The bins cover [0, 1]: the last bound is 1."""

    bins: tuple[tuple[float, int], ...]

    @classmethod
    def parse(cls, spec: str) -> CapeTable:
        """'0.3:3,0.6:2,0.9:1,1:0': below 0.3 three alternatives, up to 0.6 two, ..."""
        try:
            bins = tuple((float(b), int(n)) for b, n in (part.split(":") for part in spec.split(",")))
        except ValueError:
            raise ConfigError(f"--cape-table {spec!r}: write BOUND:ALTERNATIVES,... with ascending bounds ending "
                              f"at 1, e.g. {DEFAULT_TABLE}.") from None
        bounds = [b for b, _ in bins]
        if not bins or bounds != sorted(bounds) or len(set(bounds)) != len(bounds) or not 0 < bounds[0] \
                or bounds[-1] != 1.0 or any(n < 0 for _, n in bins):
            raise ConfigError(f"--cape-table {spec!r} does not cover the confidences [0, 1]: the bounds must ascend "
                              f"from above 0 to exactly 1, each with >= 0 alternatives (e.g. {DEFAULT_TABLE}).")
        return cls(bins)

    def alternatives(self, confidence: float) -> int:
        """(A NaN draft proposes its chain alone: the target's verification decides every token anyway.)"""
        return 0 if math.isnan(confidence) else next(n for bound, n in self.bins if confidence <= bound)


@dataclass
class Tree:
    tokens: list[int]    # node tokens; node 0 is the pending token (the root)
    parents: list[int]   # parent node of each node (-1 for the root)
    depths: list[int]
    chain: list[int]     # the node of the chain at each depth 1..K

    def visible(self) -> torch.Tensor:
        """[n, n] bool: node j sees its ancestors and itself."""
        n = len(self.tokens)
        seen = torch.zeros(n, n, dtype=torch.bool)
        for j in range(n):
            a = j
            while a >= 0:
                seen[j, a] = True
                a = self.parents[a]
        return seen


def propose_tree(drafter, pending: int, k: int, table: CapeTable, stop_below: float = 0.0, state=None) -> Tree:
    """The draft's greedy chain of up to k tokens (stop_below: as ModelDrafter.propose), with each
    step's alternatives by the table. `state`: the penalties' state after pending (tree_round's), applied
    to the draft's q as the target's logits get it: a chain of the unpenalised argmax was what the target
    then replaced (a self-draft kept 24 of 36 proposals under repetition_penalty 1.8, its chain all)."""
    chain, q = drafter.propose(pending, k, SOFTMAX_PROBS, None, stop_below, state)
    tree = Tree([pending], [-1], [0], [])
    parent = 0
    for i, d in enumerate(chain):
        node = len(tree.tokens)
        tree.tokens.append(d)
        tree.parents.append(parent)
        tree.depths.append(i + 1)
        tree.chain.append(node)
        extra = table.alternatives(float(q[i].max()))
        if extra:
            # the next most likely tokens but d, `extra` at most: where q ties at its top, topk may leave d out,
            # and all its extra + 1 would make a tree larger than the table (and the cache's room) allows. Only
            # tokens the draft gives a probability: past a reduced vocabulary's few (draft.vocab) or where its
            # softmax underflows, topk fills up with ids the draft never proposes, nodes verified for nothing
            top = torch.topk(q[i], min(extra + 1, q.shape[-1]))
            alternatives = [a for a, w in zip(top.indices.tolist(), top.values.tolist()) if a != d and w > 0]
            for alt in alternatives[:extra]:
                tree.tokens.append(int(alt))
                tree.parents.append(parent)
                tree.depths.append(i + 1)
        parent = node
    return tree


# the draft's own distribution (softmax), so confidences are probabilities; choices stay greedy
SOFTMAX_PROBS = Sampling(temperature=1.0)  # (propose without a generator: the most likely token)


def tree_round(target, cache, drafter, pending: int, k: int, table: CapeTable, stop_below: float = 0.0,
               state=None, rows: list | None = None) -> tuple[list[int], int, int, int]:
    """One CaPE round (greedy): the kept tokens, the next pending one, the chain's length and the nodes
    verified past the root (the chain and its alternatives). `cache`: the target's, on
    one device (models/kv_cache.KVCache) or sharded over head x ctx ranks (generate/sharded.py),
    every rank running the same round. `state`: the penalties' state after pending
    (generate/sampling.py Processors, one row): each node's logits are penalised with its ancestors
    (Processors.paths), so the target's choice after each node is plain greedy decoding's with them.
    `rows`, when given, receives the processed logits of the root and of each kept node (logprobs)."""
    tree = propose_tree(drafter, pending, k, table, stop_below, state)
    start = int(cache.lengths[0])
    device = cache.k.device
    tokens = torch.tensor([tree.tokens], device=device)
    positions = start + torch.tensor([tree.depths], device=device)
    cache.among(tree.visible())
    logits = target(tokens, positions, cache=cache)[0].float()
    if state is not None:
        logits = state.paths([_path(tree, j) for j in range(len(tree.tokens))])(logits)
    choice = greedy_choice(logits).tolist()  # the target's after each node (UNCHOSEN: not finite, matches none)
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(tree.parents[1:], 1):
        children.setdefault(parent, []).append(j)
    kept, node = [], 0
    while True:
        nxt = next((c for c in children.get(node, []) if tree.tokens[c] == choice[node]), None)
        if nxt is None:
            break
        kept.append(nxt)
        node = nxt
    check_chosen(choice[node], "the target's")
    cache.keep([0] + kept)  # the root and the accepted path; the other nodes are forgotten
    if rows is not None:
        rows.extend(logits[[0] + kept])
    on_chain = 0
    while on_chain < len(kept) and kept[on_chain] == tree.chain[on_chain]:
        on_chain += 1
    extra = tree.tokens[kept[-1]] if len(kept) > on_chain else None  # a kept alternative ends the path
    drafter.accepted(on_chain, len(tree.chain), extra, nodes=[0] + kept)
    return [tree.tokens[j] for j in kept], choice[node], len(tree.chain), len(tree.tokens) - 1


def _path(tree: Tree, node: int) -> list[int]:
    """The tokens from the root's child down to `node` (the root, the pending token, excluded)."""
    path = []
    while node > 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]
