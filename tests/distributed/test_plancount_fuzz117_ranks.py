"""Model-state bytes per rank of random tiny models under sharded layouts, against the tensors a real training step
leaves on each gloo rank (the one-process part and the activations: tests/unit/test_plancount_fuzz117.py).

Each rank builds its model as training does (train/model.py build_llama_training, the optimizer of step/optimizer.py),
runs one optimizer step and sums, by storage, its parameters' local shards (FSDP2 keeps each in a storage padded to
torch.chunk's first chunk), their gradients and AdamW's moments (tests/plancount_fuzz117_count.py state_bytes). The
draws have widths the FSDP group does not divide (vocabularies of 37 / 61 / 101 rows, 3 or 6 heads of 4 to 8, odd
ffn widths, 2 to 7 experts), so the shards are uneven. costs/model_states.py predicted_model_state_bytes documents
"the largest rank's" shards: the largest rank must hold exactly that, and no rank more. Layouts: FSDP over 3 ranks
(states on the device and in host memory), HSDP 2 x 2, FSDP x context parallel 2 x 2, ZeRO++ hpz (dim 0 everywhere),
expert parallelism 2 over 4 ranks (hpz and the 3-rank MoE draws with fewer experts than ranks, where FSDP2 shards the
experts on dim 0 under hpz and on another dim elsewhere: costs/model_states.py shard_dim).
"""

import pytest

from longctx.config import build_config, to_dict
from longctx.costs.host_bytes import host_state_bytes
from longctx.costs.model_states import param_counts, predicted_model_state_bytes
from longctx.job.spawn import run_spawned
from plancount_fuzz117_count import config, draw_model, state_bytes

pytestmark = pytest.mark.slow  # two jobs of 3 and 4 gloo ranks, 4 models each: ~25-50 s on 2 cores


def _worker(raws: list[dict]) -> list[dict]:
    import torch

    from longctx.job import comm
    from longctx.job.runtime import Runtime
    from longctx.planner.validate_ranks import random_batch, train_step
    from longctx.step.optimizer import make_optimizer
    from longctx.train.host_budget import run_shape
    from longctx.train.model import build_llama_training

    out = []
    for raw in raws:
        cfg = build_config(raw)
        mesh = comm.world_mesh()
        rt = Runtime.create(cfg, mesh.get_rank(), mesh.size(), "cpu")
        model = build_llama_training(cfg, torch.device("cpu"), rt, log=lambda *a, **k: None)
        opt = make_optimizer(model, cfg)
        train_step(cfg, rt, model, opt, random_batch(cfg), 1.0, zero_grad=False)
        getattr(opt, "finish_update", lambda: None)()
        out.append({"states": state_bytes(model, opt), "shape": run_shape(cfg, rt.dims)})
        comm.barrier()
    return out


def _case(seed: int, moe: bool, parallel: dict, tier: str = "device", experts: int = 0) -> dict:
    keys = draw_model(seed, moe=moe)
    if parallel.get("expert", 1) > 1:  # (experts over the expert degree; their widths over the expert-data group)
        keys.update({"moe.experts": 4, "moe.expert_dim": 14})
    if experts:  # fewer experts than FSDP ranks: FSDP2 shards their [experts, ...] tensors on another dim, not hpz
        keys.update({"moe.experts": experts, "moe.top_k": 1, "moe.expert_dim": 12})
    return to_dict(config(keys, {"model_states": tier}, parallel, seq_len=24, global_batch=4))


THREE = [_case(0, False, {"dp_shard": 3}), _case(5, True, {"dp_shard": 3}), _case(4, False, {"dp_shard": 3}, "host"),
         _case(8, True, {"dp_shard": 3})]
FOUR = [_case(1, False, {"dp_replicate": 2, "dp_shard": 2}), _case(2, True, {"dp_shard": 2, "ctx": 2}),
        _case(3, True, {"dp_shard": 4, "zero_pp": "hpz", "ranks_per_node": 2}, experts=3),
        _case(11, True, {"dp_shard": 4, "expert": 2})]


@pytest.fixture(scope="module")
def measured():
    return {3: run_spawned(3, _worker, THREE), 4: run_spawned(4, _worker, FOUR)}


@pytest.mark.parametrize("world,index", [(3, i) for i in range(len(THREE))] + [(4, i) for i in range(len(FOUR))])
def test_each_ranks_states_are_the_counted_largest_shard(measured, world, index):
    raw = (THREE if world == 3 else FOUR)[index]
    cfg = build_config(raw)
    ranks = [r[index] for r in measured[world]]
    shape = ranks[0]["shape"]
    assert all(r["shape"] == shape for r in ranks)
    predicted = predicted_model_state_bytes(cfg.model, shape)
    held = [sum(r["states"].values()) for r in ranks]
    what = f"{cfg.parallel} {cfg.memory.model_states}: per rank {[r['states'] for r in ranks]}, counted {predicted}"
    assert max(held) == predicted, what
    # every rank's weights and gradients sit in storages padded to the first chunk (the moments follow each rank's
    # own chunk: AdamW makes them with zeros_like of the unpadded local tensor)
    assert all(r["states"]["params"] == r["states"]["grads"] == predicted / 4 for r in ranks), what
    # (the padding is real in these draws: an even split of the parameters is below what the fullest rank holds)
    assert 16 * param_counts(cfg.model)["total"] * shape.dp_replicate / shape.world < predicted, what
    if cfg.memory.model_states == "host":
        assert host_state_bytes(cfg.model, shape, "host") == predicted, what
