"""Audit of speculative decoding's exactness (generate/speculative.py, cape.py, acceptance.py):
- CaPE adds at most the table's alternatives per depth, also where the draft's distribution ties at its
  top (topk may then leave the chain's own token out): the tree stays within the cache's room and the
  output is plain greedy decoding;
- the acceptance rule alone, on hand-made p and q (zeros on either side, p = q): each emitted position
  is distributed as p's row there."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from longctx.config import load_config
from longctx.generate.acceptance import accept
from longctx.generate.cape import DEFAULT_TABLE, CapeTable, propose_tree
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.generate.speculative import speculative_generate
from longctx.models.llama import build_model

VOCAB = 8


class TiedDrafter:
    """A drafter whose q ties five tokens at its top (0.2 each: the default table's 3 alternatives) and
    proposes the tied token that topk(q, 4) leaves out (a valid greedy choice: one of q's maxima)."""

    def __init__(self):
        self.q = torch.zeros(VOCAB)
        self.q[[1, 2, 4, 5, 6]] = 0.2
        left_out = set(range(VOCAB)) - set(torch.topk(self.q, 4).indices.tolist())
        self.d = next(t for t in (1, 2, 4, 5, 6) if t in left_out)

    def start(self, prompt, target_cache=None):
        pass

    def propose(self, pending, k, sampling, generator, stop_below=0.0, processors=None):
        return [self.d] * k, self.q.repeat(k, 1)

    def accepted(self, n, k, extra=None, nodes=None):
        pass

    def skipped(self, pending):
        pass


def test_cape_tree_has_the_tables_alternatives_when_the_draft_ties():
    drafter, table = TiedDrafter(), CapeTable.parse(DEFAULT_TABLE)
    tree = propose_tree(drafter, 0, 4, table)
    per_depth = [tree.depths.count(depth) for depth in range(1, 5)]
    assert per_depth == [1 + 3] * 4, per_depth  # the chain's token and 3 alternatives, not 4
    assert len(tree.tokens) == 1 + 4 * (1 + 3)
    overrides = ["--model.layers=1", f"--model.vocab_size={VOCAB}", "--model.dim=32", "--model.heads=2",
                 "--model.kv_heads=1", "--model.ffn_dim=64"]
    target = build_model(load_config(overrides=overrides).model, seed=1).eval()
    prompt = [3, 1, 4, 1, 5]
    plain = generate(target, [prompt], max_new_tokens=12)[0].tokens
    # (before: 21 nodes per round against a room of 17, and the cache overflowed near the limit)
    spec = speculative_generate(target, drafter, prompt, max_new_tokens=12, k=4, cape=table)
    assert spec.tokens == plain


def test_the_acceptance_rule_keeps_each_positions_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2, 0, 0], [0.1, 0.0, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0],
                      [0, 0, 0, 0.1, 0.9]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.6, 0.0], [0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.5, 0.0, 0.5]])
    g, s = torch.Generator().manual_seed(1), Sampling(temperature=1.0)
    counts = np.zeros((4, 5))
    for _ in range(6000):
        proposals = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(3)]
        kept, following = accept(proposals, q, p, s, g)
        for i, t in enumerate(proposals[:kept] + [following]):
            counts[i, t] += 1
    for i in range(4):
        expected = p[i].double().numpy() * counts[i].sum()
        assert counts[i][expected == 0].sum() == 0, (i, counts[i])
        nz = expected > 0
        if nz.sum() > 1:
            assert chisquare(counts[i][nz], expected[nz] / expected[nz].sum() * counts[i][nz].sum()).pvalue > 1e-3


class PeakedDrafter(TiedDrafter):
    """A drafter sure of two tokens only: q is 0.6 / 0.4 on ids 5 and 2, exactly 0 elsewhere (a reduced
    vocabulary's, or a softmax underflowed)."""

    def __init__(self):
        self.q = torch.zeros(VOCAB)
        self.q[5], self.q[2] = 0.6, 0.4
        self.d = 5


def test_cape_adds_no_alternative_the_draft_gives_no_probability():
    tree = propose_tree(PeakedDrafter(), 0, 3, CapeTable.parse("1:3"))  # 3 alternatives asked at every depth
    # (before: 5, 2 and two ids of q = 0 at every depth)
    assert [tree.tokens[j] for j in range(1, len(tree.tokens))] == [5, 2] * 3


@pytest.mark.parametrize("sampling", [Sampling(repetition_penalty=1.8), Sampling(presence_penalty=1.5)])
def test_a_self_drafts_cape_tree_keeps_every_proposal_under_penalties(sampling):
    """The target as its own draft proposes what it then chooses, penalties included: CaPE's chain keeps
    every proposal, as the chain's speculation does (before: the tree's draft ran unpenalised, 24 of 36
    and 5 of 24 kept; the output was the target's all the same)."""
    from longctx.generate.drafters import ModelDrafter

    overrides = ["--model.layers=2", "--model.vocab_size=16", "--model.dim=32", "--model.heads=2",
                 "--model.kv_heads=1", "--model.ffn_dim=64"]
    target = build_model(load_config(overrides=overrides).model, seed=3).eval()
    prompt = [1, 2, 3, 4, 5, 1, 2]
    plain = generate(target, [prompt], max_new_tokens=30, sampling=sampling, eos_ids=[0])[0].tokens
    spec = speculative_generate(target, ModelDrafter(target, 80), prompt, max_new_tokens=30, k=4, sampling=sampling,
                                eos_ids=[0], cape=CapeTable.parse("1:0"))
    assert spec.tokens == plain
    assert sum(spec.accepted) == sum(spec.proposed) > 0, (spec.accepted, spec.proposed)
