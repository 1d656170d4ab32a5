"""The segment plan cached on a query document-id tensor belongs to the key ids it was built with.

ops/segments.py cached_plan keeps a batch's plan on the query ids, for every layer and backward of the
step. Its key named the key ids by id(), which CPython gives to a new tensor once the old one is
freed: attention of the same query ids against NEW key ids then reused the plan of the freed ones
and attended the wrong keys, silently (until 2026-11-29; out off by up to ~1.5 on the case below).
"""

import torch

from longctx.ops.attention import attention


def test_new_key_ids_at_a_reused_address_get_their_own_plan():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1, 8, generator=gen) for _ in range(3))
    q_doc = torch.tensor([[0, 0, 1, 1]])
    reused = 0
    addresses = set()
    for step in range(200):
        k_doc = torch.tensor([[step % 2] * 4])  # every key in document 0, then every key in document 1
        reused += id(k_doc) in addresses
        addresses.add(id(k_doc))
        out, _ = attention(q, k, v, causal=False, q_doc=q_doc, k_doc=k_doc)
        fresh, _ = attention(q, k, v, causal=False, q_doc=q_doc.clone(), k_doc=k_doc.clone())  # nothing cached
        assert torch.equal(out, fresh), f"step {step}: the plan of freed key ids was reused"
        del k_doc  # freed here: its address is free for the next step's tensor
    assert reused, "no key-id tensor was allocated at a freed one's address: the case was not exercised"


def test_a_plan_is_still_reused_for_the_same_ids():
    """The cache still serves the case it is for: the same tensors, unchanged, plan once."""
    from longctx.ops.segments import cached_plan

    doc = torch.tensor([[0, 0, 1, 1, 1]])
    assert cached_plan(doc, doc, True) is cached_plan(doc, doc, True)
    other = doc.clone()
    assert cached_plan(doc, other, True) is not cached_plan(doc, doc, True)
    doc[0, 4] = 2  # written in place: planned anew
    assert cached_plan(doc, doc, True).num_pairs == 3


def test_ids_that_carry_a_plan_still_pickle_and_plan_anew():
    import pickle

    from longctx.ops.segments import cached_plan

    doc = torch.tensor([[0, 0, 1, 1]])
    kept = cached_plan(doc, doc, True)
    copy = pickle.loads(pickle.dumps(doc))  # (torch.save of a batch after a forward pickles the same way)
    assert torch.equal(copy, doc) and cached_plan(copy, copy, True) is not kept
