"""qwZ's block quantisation (parallel/fsdp/quantized.py): the rounding bound, zeros, padding and the
output dtype; the compiled kernels bit-identical to the eager ones; parallel.zero_pp_kernels; and the
block-size check against the smallest unit's shard."""

import pytest
import torch

from longctx.parallel.fsdp.quantized import dequantize_blocks, quantize_blocks


@pytest.mark.parametrize("n,block", [(1000, 64), (4096, 512), (7, 4)])
def test_rounding_is_at_most_half_a_step_of_each_block(n, block):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)  # magnitudes that differ by block
    q, scale = quantize_blocks(x, block)
    assert q.dtype == torch.int8 and q.numel() == -(-n // block) * block and scale.numel() == -(-n // block)
    back = dequantize_blocks(q, scale, n, torch.float32)
    step = scale.repeat_interleave(block)[:n]  # each element's block: largest magnitude / 127
    assert torch.all((back - x).abs() <= step / 2 + 1e-7 * x.abs())
    assert torch.all((back - x).abs() <= x.abs().max() / 254 + 1e-6)


def test_zero_blocks_stay_zero_and_the_largest_magnitude_is_exact():
    x = torch.zeros(256)
    x[130] = -3.5
    q, scale = quantize_blocks(x, 128)
    back = dequantize_blocks(q, scale, 256, torch.float32)
    assert torch.count_nonzero(back[:128]) == 0 and back[130] == -3.5


def test_the_output_takes_the_gather_dtype():
    x = torch.randn(300, dtype=torch.bfloat16)
    q, scale = quantize_blocks(x, 32)
    back = dequantize_blocks(q, scale, 300, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and (back.float() - x.float()).abs().max() < 0.05


def test_a_block_longer_than_the_smallest_shard_is_refused():
    from types import SimpleNamespace

    from longctx.config import load_config
    from longctx.errors import ConfigError
    from longctx.parallel.fsdp.shard import quantize_gathers

    cfg = load_config("configs/debug.toml", ["--parallel.zero_pp=qwz", "--parallel.zero_pp_block=512"])
    units = [torch.nn.Linear(40, 40), torch.nn.Linear(40, 40), torch.nn.Linear(4, 4)]  # the last: the root
    dims = SimpleNamespace(world_size=4, dp_replicate=1)
    with pytest.raises(ConfigError, match=r"smallest FSDP unit's shard \(410 elements per rank\)"):
        quantize_gathers(units, cfg, dims)
    assert quantize_gathers(units, load_config("configs/debug.toml", []), dims) is None  # qwz off


def test_an_expert_units_shard_is_its_global_size_over_every_rank():
    """Under expert parallelism an experts unit's parameters are DTensors of the global [experts, ...] shape, split
    over the expert group (dim 0) and FSDP-sharded over the expert-data group: a rank holds 1 / world of them, not
    1 / (world / expert), which let a block up to `expert` times longer than its real shard through."""
    from types import SimpleNamespace

    from longctx.config import load_config
    from longctx.errors import ConfigError
    from longctx.parallel.fsdp.shard import quantize_gathers

    cfg = load_config("configs/debug.toml", ["--parallel.zero_pp=qwz", "--parallel.zero_pp_block=600"])
    units = [torch.nn.Linear(80, 80), torch.nn.Linear(4, 4)]  # a block (6,480 elements: 1,620 a rank) and the root
    experts = torch.nn.Module()
    experts.w = torch.nn.Parameter(torch.zeros(4, 40, 40))  # 6,400 elements over 4 ranks: 1,600 a rank, not 3,200
    experts_small = torch.nn.Module()
    experts_small.w = torch.nn.Parameter(torch.zeros(4, 20, 20))  # 1,600 over 4: 400 a rank, under the block
    dims = SimpleNamespace(world_size=4, dp_replicate=1, expert=2)
    with pytest.raises(ConfigError, match=r"smallest FSDP unit's shard \(400 elements per rank\)"):
        quantize_gathers(units, cfg, dims, expert_units=[experts, experts_small])


def _has_compiler() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


needs_compiler = pytest.mark.skipif(not _has_compiler(), reason="torch.compile on CPU needs a C++ compiler")


@needs_compiler
def test_the_compiled_kernels_give_the_eager_ones_bits():
    # one compile, dynamic in the number of blocks: several sizes (and a padded tail), the same bits
    g = torch.Generator().manual_seed(0)
    for n, block in [(4096 * 3 + 17, 512), (1000, 64), (64, 64)]:
        x = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)
        x[:block] = 0  # an all-zero block
        q, scale = quantize_blocks(x, block)
        qc, scalec = quantize_blocks(x, block, compiled=True)
        assert torch.equal(q, qc) and torch.equal(scale, scalec)  # (dequantising: the training path's test below)


@pytest.mark.parametrize("kernels,device,compiled", [("auto", "cpu", False), ("auto", "cuda", True),
                                                     ("compiled", "cpu", True), ("eager", "cuda", False)])
def test_the_kernels_setting_picks_compiled_on_cuda_by_default(kernels, device, compiled):
    from longctx.parallel.fsdp.quantized import use_compiled

    assert use_compiled(kernels, device) is compiled


def test_an_unknown_kernels_setting_is_refused_before_launch():
    from longctx.config import load_config
    from longctx.errors import ConfigError
    from longctx.job.checks import check_layout

    cfg = load_config("configs/debug.toml", ["--parallel.zero_pp=qwz", "--parallel.zero_pp_kernels=triton"])
    with pytest.raises(ConfigError, match="zero_pp_kernels must be one of auto, compiled, eager, got 'triton'"):
        check_layout(cfg, 1)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3 * 512, 3 * 512 - 5])
def test_the_training_paths_kernels_give_the_eager_ones_bits(dtype, n):
    # what FSDP's hooks run: qwz's gathered rows dequantised into the output buffer (in the gather dtype),
    # qgz's node rows dequantised and summed; through pack_blocks / unpack_blocks as a collective leaves them
    from longctx.parallel.fsdp.quantized import _kernel, _whole_blocks, pack_blocks, unpack_blocks

    g = torch.Generator().manual_seed(n)
    world, block = 4, 512
    shards = (torch.randn(world, n, generator=g) * torch.logspace(-3, 2, n)).to(dtype)
    outs = {}
    for compiled in (False, True):
        q, scale = _kernel("quantize", compiled)(_whole_blocks(shards, block))
        got_q, got_scale = unpack_blocks(pack_blocks(q.view(world, -1), scale), q[0].numel())
        out = torch.empty(world, n, dtype=dtype)
        _kernel("dequantize_into", compiled)(out, got_q.view(world, -1, block), got_scale)
        summed = _kernel("dequantize_sum", compiled)(got_q.view(world, -1, block), got_scale)
        outs[compiled] = (q, scale, out, summed)
    for eager, compiled in zip(outs[False], outs[True]):
        assert torch.equal(eager, compiled)
    assert (outs[True][2].float() - shards.float()).abs().max() <= shards.float().abs().max() / 200


def test_a_machine_that_cannot_compile_the_kernels_is_one_clear_error(monkeypatch):
    from longctx.errors import ConfigError
    from longctx.parallel.fsdp import quantized

    def broken(name, compiled):
        def fail(*a):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return fail if compiled else quantized._KERNELS[name]

    monkeypatch.setattr(quantized, "_kernel", broken)
    with pytest.raises(ConfigError, match=r"could not build ZeRO\+\+'s int8 kernels on cpu \(RuntimeError: "
                                          r"InvalidCxxCompiler.*--parallel.zero_pp_kernels eager"):
        quantized.warm_up(torch.device("cpu"), torch.float32, 64)


@needs_compiler
def test_the_kernels_benchmark_runs_and_compares_the_bits(tmp_path):
    # benchmarks/zero_pp_kernels.py, as benchmarks/gpu_speed.sh runs it on a card, here on the CPU
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "zero_pp_kernels.py"
    out = tmp_path / "k.json"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--elements", "65536", "--dtype", "bf16",
                          "--repeats", "1", "--threads", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["kernels"]) == {"eager", "compiled"}
    assert all(r["identical_to_eager"] and r["quantize_gbps"] > 0 for r in doc["kernels"].values())
