"""benchmarks/moe_roofline.py, the H200 roofline of `longctx bench moe`'s MoE and dense layers: each op's FLOPs and
bytes extrapolated from two token counts equal those recorded at the target (the layer's op stream is linear in
tokens), the GEMMs are the dense layer's FLOPs, and nothing reads the host."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_roofline as mr  # noqa: E402
from longctx.ops.grouped import cpu_kernel_available  # noqa: E402

DIM, EXPERTS, TOP_K, EXPERT_DIM = 64, 8, 2, 32


@pytest.mark.skipif(not cpu_kernel_available(), reason="this torch has no CPU torch._grouped_mm")
def test_extrapolated_ops_equal_the_ops_recorded_at_the_target():
    moe, dense = mr.layers_bf16(mr.bench_args(DIM, EXPERTS, TOP_K, EXPERT_DIM))
    (small, _), (large, sites), (target, _) = (mr.record_layer(moe, t, DIM) for t in (32, 64, 256))
    guessed = mr.at_target(small, large, 32, 64, 256)
    assert [(o.name, o.kind) for o in guessed] == [(o.name, o.kind) for o in target]
    for g, t in zip(guessed, target):
        assert g.flops == pytest.approx(t.flops) and g.bytes == pytest.approx(t.bytes), (g, t)
    est = mr.summary(mr.table(guessed, sites))
    assert est["host_reads"] == 0
    dense_ops, _ = mr.record_layer(dense, 256, DIM)
    gemm = lambda ops: sum(o.flops for o in ops if o.kind == "matmul bf16")  # noqa: E731
    assert gemm(target) == pytest.approx(gemm(dense_ops))  # equal active parameters: equal GEMM FLOPs
