"""generate/contracts.py on a sharded layout: on each of head 1 x ctx 2 ranks the sharded backend, its
cache (and a row view of it) and a layer of it are the runtime-checkable Protocols' (the one-device
ones, and every implementation's signatures: tests/unit/test_generate_contracts.py)."""

import torch

from longctx.job.spawn import run_spawned


def _check_rank() -> dict:
    from longctx.config import load_config
    from longctx.generate import contracts
    from longctx.generate.sharded import ShardedGeneration
    from longctx.job.runtime import Runtime
    from longctx.models.llama import build_model

    model = build_model(load_config(overrides=["--model.layers=2"]).model, seed=0).eval()
    rt = Runtime.create(load_config(overrides=["--parallel.ctx=2"]), torch.distributed.get_rank(), 2, "cpu")
    backend = ShardedGeneration(rt.mesh, rt.world_mesh)
    cache = backend.cache(model, 2, 32)
    return {"backend": isinstance(backend, contracts.Backend),
            "flat": isinstance(backend, contracts.FlatPrefill),  # (no: one length group per prefill call)
            "cache": isinstance(cache, contracts.Cache), "rows": isinstance(cache.rows(0, 1), contracts.Cache),
            "layer": isinstance(cache.layer(0), contracts.CacheLayer)}


def test_the_sharded_backend_and_cache_satisfy_the_contracts():
    for found in run_spawned(2, _check_rank):
        assert found == {"backend": True, "flat": False, "cache": True, "rows": True, "layer": True}
