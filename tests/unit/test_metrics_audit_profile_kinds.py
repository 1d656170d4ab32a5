"""The kinds a profiled step's time is summed into (train/profile_step.py kind_of: the `profile:` log line's shares and
step<N>_top.json's by_kind). The aten op marks matched anywhere in a name, so "aten::to" (the dtype/device cast) also
took aten::topk, a MoE router's top-k choice: its CPU time was said as "copy". An op mark names an op and its
variants (aten::addmm_, aten::to_dense), not every op whose name starts with the same letters."""

import pytest

from longctx.train.profile_step import kind_of


@pytest.mark.parametrize("name,kind", [
    ("aten::topk", "other"),            # a router's choice, no copy
    ("aten::to", "copy"),
    ("aten::_to_copy", "copy"),
    ("aten::copy_", "copy"),
    ("aten::to_dense", "copy"),         # a layout conversion: a copy of the tensor
    ("aten::mm", "matmul"),
    ("aten::addmm_", "matmul"),         # (in place)
    ("aten::linear_backward", "matmul"),
    ("aten::_grouped_mm", "matmul"),    # (a kernel mark, anywhere in the name)
    ("aten::mse_loss", "other"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
])
def test_each_op_is_in_its_own_kind(name, kind):
    assert kind_of(name) == kind
