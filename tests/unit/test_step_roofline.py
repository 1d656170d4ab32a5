"""benchmarks/step_roofline.py, the roofline audit of one training step: its op classes and times, and what it
says of longctx's own step (debug preset, CPU, seconds): every matmul in bf16 under autocast, no host read inside
the step (on a GPU each is a sync), and per layer no more casts than transformers' peer makes."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_roofline as sr  # noqa: E402


def _ops(fn, params=frozenset()):
    rec = sr.Recorder(set(params))
    with rec:
        fn()
    return rec.ops


def test_matmul_flops_and_rates_by_dtype():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    (fp32,) = _ops(lambda: a @ b)
    (bf16,) = _ops(lambda: a.bfloat16() @ b.bfloat16())[-1:]
    assert fp32.kind == "matmul fp32" and bf16.kind == "matmul bf16"
    assert fp32.flops == bf16.flops == 2 * 64 * 32 * 16
    # a matmul this small is bound by its bytes; a large one by its FLOPs, at the dtype's peak
    big = sr.classify(torch.ops.aten.mm.default, (torch.empty(4096, 4096), torch.empty(4096, 4096)), {},
                      torch.empty(4096, 4096), set())
    assert big.seconds == big.flops / sr.FP32_FLOPS


def test_views_are_free_and_casts_are_told_apart():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    ops = _ops(lambda: (w.t().to(torch.bfloat16), x.view(64).float()), {w.untyped_storage().data_ptr()})
    assert [op.kind for op in ops] == ["cast of a weight", "cast of an activation"]
    assert ops[0].bytes == 64 * (4 + 2) and ops[1].bytes == 64 * (2 + 4)


def test_in_place_ops_count_what_they_read_and_write():
    a, b = torch.randn(100), torch.randn(100)
    (add,) = _ops(lambda: a.add_(b))
    (copy,) = _ops(lambda: a.copy_(b))
    assert add.bytes == 3 * 400 and copy.bytes == 2 * 400


def _kinds(table) -> dict:
    kinds: dict[str, int] = {}
    for key, row in table.items():
        kinds[key[0]] = kinds.get(key[0], 0) + row[3]
    return kinds


def test_our_step_is_bf16_matmuls_without_host_reads():
    kinds = _kinds(sr.record("ours", "debug", 1, 64, 32)["table"])
    assert kinds["matmul bf16"] > 0 and "matmul fp32" not in kinds
    assert kinds["host read (a GPU sync)"] == 1  # the audit's own loss.item() after the step


def test_our_layer_casts_no_more_than_the_peer():
    def per_layer(which):
        one, two = (_kinds(sr.record(which, "debug", n, 64, 32)["table"]) for n in (1, 2))
        return {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two)}

    ours, peer = per_layer("ours"), per_layer("peer")
    for kind in ("cast of an activation", "cast of a weight", "matmul bf16"):
        assert ours[kind] <= peer[kind], (kind, ours[kind], peer[kind])
