"""Caches kept on document-id tensors (segment plans, chunk grids, sequence layouts) follow the ids.

Inference tensors (torch.inference_mode) track no version: document masks on them must work, and
be planned afresh (their ids may be rewritten unseen). A sequence layout attached to ids is refused
once the ids are written in place; one planned from the ids alone (derived) is forgotten instead.
"""

import pytest
import torch

from longctx.ops.attention import attention
from longctx.ops.chunked import chunked_local_attention
from longctx.parallel.context.sequence import attach_layout, layout_of, plan_layout


def _inputs():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 12, 4, 8, generator=g) for _ in range(3))


def _ids(*cuts):
    doc = torch.zeros(2, 12, dtype=torch.long)
    for c in cuts:
        doc[:, c:] += 1
    return doc


def test_document_masks_under_inference_mode_follow_rewritten_ids():
    q, k, v = _inputs()
    refs = [attention(q, k, v, q_doc=d, k_doc=d, backend="math")[0] for d in (_ids(5), _ids(2, 9))]
    with torch.inference_mode():
        ids = _ids(5)  # an inference tensor
        outs = [attention(q, k, v, q_doc=ids, k_doc=ids)[0], chunked_local_attention(q, k, v, ids, chunk=5)]
        ids.copy_(_ids(2, 9))  # rewritten in place: no version counter tells
        outs += [attention(q, k, v, q_doc=ids, k_doc=ids)[0], chunked_local_attention(q, k, v, ids, chunk=5)]
    for out, ref in zip(outs, [refs[0], refs[0], refs[1], refs[1]]):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_an_attached_layout_refuses_ids_written_in_place():
    layout = plan_layout(_ids(5), 2, 1)
    ids = attach_layout(torch.zeros(2, 6, dtype=torch.long), layout)
    assert layout_of(ids) is layout
    ids.add_(1)
    with pytest.raises(ValueError, match="changed in place after their sequence layout was attached"):
        layout_of(ids)


def test_a_derived_layout_is_forgotten_when_the_ids_change():
    layout = plan_layout(_ids(5), 2, 1, balance="zigzag")
    ids = attach_layout(torch.zeros(2, 6, dtype=torch.long), layout, derived=True)
    assert layout_of(ids) is layout
    ids.add_(1)
    assert layout_of(ids) is None
