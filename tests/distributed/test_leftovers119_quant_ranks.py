"""ZeRO++ over gloo ranks (tests/unit/test_leftovers119_quant.py has the in-process cases):

- qgZ (QuantizedReduceScatter) returns inf only where gloo's own fp32 reduce-scatter of the same gradients is
  non-finite: 4 ranks on every node split, gradients near fp32's largest value (until 2026-12-07 its fp32 sums of
  the dequantised gradients overflowed where the exact sum was finite, and a node sum's inf became nan);
- which parameters travel in int8 under parallel.zero_pp = qwz,qgz on a MoE model (docs/parallelism.md): where
  the blocks gather bf16 (a GPU; made so here) each router is an FSDP unit of its own gathered in fp32 and
  reduce-scattered by FSDP itself, the rest quantised; where they gather fp32 (CPU) the router is part of its
  block's unit and quantised with it."""

from __future__ import annotations

import pytest

from longctx.job.spawn import run_spawned, run_spawned_many

pytestmark = pytest.mark.slow


def _near_top_against_gloo(seed: int) -> list[str]:
    import random

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from longctx.parallel.fsdp.quantized import QuantizedReduceScatter

    top, rank, rng, problems = torch.finfo(torch.float32).max, dist.get_rank(), random.Random(seed), []
    for nodes, local in [(2, 2), (1, 4), (4, 1)] * 2:
        mesh = DeviceMesh("cpu", torch.arange(4).reshape(1, nodes, local),
                          mesh_dim_names=("dp_replicate", "inter", "intra"))
        block, n = rng.choice([1, 3, 8]), rng.choice([7, 32])
        g = torch.Generator().manual_seed(rng.randrange(2 ** 31))  # (the same on every rank: take this rank's row)
        signs = torch.where(torch.rand(4, 4 * n, generator=g) < 0.5, -1.0, 1.0).double()
        grads = (signs * (0.1 + 0.9 * torch.rand(4, 4 * n, generator=g, dtype=torch.float64)) * top / 1.5).float()
        out, plain = torch.full((n,), 99.0), torch.empty(n)
        QuantizedReduceScatter(block, mesh)(out, grads[rank].clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        dist.reduce_scatter_tensor(plain, grads[rank].clone(), group=dist.group.WORLD)
        exact = grads.double().sum(0).view(4, n)[rank]
        label = f"{nodes} x {local} block {block}"
        if (out.isinf() & plain.isfinite()).any():
            problems.append(f"{label}: inf where gloo's fp32 sum is {plain[out.isinf() & plain.isfinite()].tolist()}")
        if out.isnan().any() or not out[exact.abs() <= top].isfinite().all():
            problems.append(f"{label}: non-finite where the exact sum is finite: {out.tolist()} / {exact.tolist()}")
    return problems


def test_qgz_is_inf_only_where_gloos_fp32_reduce_scatter_is():
    assert run_spawned(4, _near_top_against_gloo, 119) == [[]] * 4


def _quantised_parameters(bf16_gathers: bool) -> dict[str, tuple[str, str]]:
    """Each parameter's FSDP unit's gather and reduce-scatter ("int8" or "plain") after shard_model under
    zero_pp = qwz,qgz (2 ranks, nodes of 1), and whether the router's gathered gate is the fp32 weight itself."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from longctx.config import load_config
    from longctx.job.checks import check_layout
    from longctx.models.llama import build_model
    from longctx.models.moe import moe_layers
    from longctx.parallel.fsdp import shard
    from longctx.parallel.fsdp.quantized import QuantizedAllGather, QuantizedReduceScatter

    cfg = load_config("configs/debug.toml", ["--model.preset=debug-moe", "--model.layers=2", "--model.dim=32",
                                             "--train.seq_len=64", "--train.global_batch=2",
                                             "--parallel.zero_pp=qwz,qgz", "--parallel.zero_pp_block=8",
                                             "--parallel.ranks_per_node=1"])
    model = build_model(cfg.model, seed=3)
    gates = [layer.router.gate.weight.detach().clone() for layer in moe_layers(model)]
    own = shard.gathers_in_bf16
    shard.gathers_in_bf16 = lambda device_type, dtype: bf16_gathers  # True: as on a GPU (this process only)
    try:
        shard.shard_model(model, check_layout(cfg, 2), cfg, "cpu")
    finally:
        shard.gathers_in_bf16 = own  # (the next job in this process shards as it would)
    names = {module: name for name, module in model.named_modules()}
    found = {}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for p in group.fsdp_params if group is not None else []:
            reduce = getattr(group._reduce_scatter_comm, "_reduce", None)  # (qgz's, inside the bucket timer)
            name = f"{names[p._module_info.module]}.{p._module_info.param_name}".lstrip(".")
            found[name] = ("int8" if isinstance(group._all_gather_comm, QuantizedAllGather) else "plain",
                           "int8" if isinstance(reduce, QuantizedReduceScatter) else "plain")
    seen = []
    for layer, gate in zip(moe_layers(model), gates):  # (after FSDP's own pre-forward: the gate is gathered)
        layer.router.register_forward_pre_hook(
            lambda router, args, gate=gate: seen.append(torch.equal(router.gate.weight.detach(), gate)))
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    model(tokens, None, None, labels=tokens).backward()
    return found, seen


def test_which_parameters_travel_in_int8_under_qwz_qgz_on_a_moe_model():
    runs = run_spawned_many(2, [("bf16", _quantised_parameters, (True,)), ("fp32", _quantised_parameters, (False,))])
    for found, exact_gates in runs["bf16"]:  # a GPU's: routers exact, the rest int8
        routers = {name for name in found if ".router." in name}
        assert routers and all(found[name] == ("plain", "plain") for name in routers), found
        assert all(how == ("int8", "int8") for name, how in found.items() if name not in routers), found
        assert exact_gates and all(exact_gates)
    for found, exact_gates in runs["fp32"]:  # a CPU's: the router is in its block's unit, int8 with it
        assert any(".router." in name for name in found)
        assert all(how == ("int8", "int8") for how in found.values()), found
        assert exact_gates and not any(exact_gates)
