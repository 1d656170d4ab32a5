"""A capacity decided over data-parallel shares from their [k, E] counts alone (models/moe_capacity.py
capacity_kept with `shares`) keeps exactly the choices the one-device decision over all their tokens
keeps: each expert's queue is slot-major, then token order, over the whole micro-batch. What travels
between shares is k x E integers, not T x k choices, so the cost does not grow with the data-parallel
degree (the head x ctx ranks of a share gather its choices: tests/distributed/test_moe_capacity_layouts.py)."""

import pytest
import torch

from longctx.models.moe_capacity import capacity_kept, choice_counts


def _skewed_choices(n, k, e, seed):
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(e, 0, -1, dtype=torch.float) ** 2  # expert 0 most wanted: queues overflow
    return torch.stack([torch.multinomial(weights, k, generator=g) for _ in range(n)])


@pytest.mark.parametrize("shares", [1, 2, 3, 5])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_shares_keep_what_one_device_keeps(shares, capacity_factor):
    e, k = 8, 2
    choices = _skewed_choices(120, k, e, seed=shares)
    whole = capacity_kept(choices, capacity_factor, e)
    assert 0 < int((~whole).sum()) < whole.numel()  # some dropped, some kept: the check can fail
    parts = torch.tensor_split(choices, [13, 40, 41, 90][:shares - 1])  # unequal shares, one of a single token
    counts = torch.stack([choice_counts(p, e) for p in parts])
    got = torch.cat([capacity_kept(p, capacity_factor, e, (counts, i)) for i, p in enumerate(parts)])
    assert torch.equal(got, whole)
    # and not by chance: deciding each share on its own keeps other choices
    if shares > 1:
        alone = torch.cat([capacity_kept(p, capacity_factor, e) for p in parts])
        assert not torch.equal(alone, whole)
