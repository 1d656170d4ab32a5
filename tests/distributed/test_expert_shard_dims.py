"""Under expert parallelism FSDP shards each rank's experts over the expert-data group (world / expert ranks) on an
inner dim, which FSDP2 splits only evenly: dim 1 where the group divides it, else dim 2
(costs/model_states.py expert_shard_dim); a layout where it divides neither is refused before launch
(job/checks.py), where FSDP2 raised "does not support uneven sharding on dim 1" inside every rank's set-up.

debug-moe with model.moe.expert_dim 65 on 4 ranks, expert 2 (expert-data groups of 2): w1 and w3 [4, 65, 128]
are sharded on dim 2, w2 [4, 128, 65] on dim 1. The run trains as one process does (the tolerance of the
expert-parallel parity tests) and holds the model states the cost model predicts."""

import pytest

from longctx.config import load_config, to_dict
from longctx.costs.model_states import predicted_model_state_bytes
from longctx.costs.shape import MeshShape
from longctx.job.spawn import run_spawned_many
from longctx.planner.validate import Case, case_config
from longctx.train.trainer import train

pytestmark = pytest.mark.slow  # one 4-rank job and one one-process run: ~40 s on a 2-core CPU

STEPS = 3
EXPERT_DIM = 65
TOL = 1e-4  # tests/distributed/test_expert_parallel.py's
BASE = ["--model.preset=debug-moe", f"--model.moe.expert_dim={EXPERT_DIM}", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300", "--train.seq_len=256",
        "--train.warmup_steps=1", f"--train.steps={STEPS}", "--checkpoint.final=false"]
CASE = Case("dp4 expert2, expert_dim 65", "debug-moe", 256, MeshShape(dp_shard=4, expert=2))


def _losses(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def _raw():
    raw = to_dict(case_config(CASE))
    raw["model"]["moe.expert_dim"] = EXPERT_DIM
    raw["parallel"]["expert"] = 2
    return raw


def _shard_dims_and_states(raw):
    from longctx.planner.validate_ranks import measured_model_state_bytes, setup_case, train_step

    job = setup_case(raw)
    train_step(*job)
    train_step(*job, zero_grad=False)  # (the gradients exist after a second step)
    model, opt = job[2], job[3]
    experts = model.layers[1].feed_forward.experts
    dims = {n: [getattr(pl, "dim", None) for pl in p.placements] for n, p in experts.named_parameters()}
    return {"dims": dims, "states": measured_model_state_bytes(model, opt)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("expert_dims")
    out = run_spawned_many(4, [("built", _shard_dims_and_states, (_raw(),)),
                               ("four", _losses, (["--parallel.dp_shard=4", "--parallel.expert=2"], f"{base}/four"))])
    out.update(run_spawned_many(1, [("one", _losses, ([], f"{base}/one"))]))
    return out


def test_experts_are_sharded_on_the_dim_the_group_divides(runs):
    for rank in runs["built"]:
        # (mesh dims expert_data, expert: FSDP's shard, then the expert group's dim 0)
        assert rank["dims"]["w1"] == rank["dims"]["w3"] == [2, 0], rank["dims"]  # [4, 65, 128]: 65 is odd
        assert rank["dims"]["w2"] == [1, 0], rank["dims"]                         # [4, 128, 65]


def test_states_held_are_predicted(runs):
    m = load_config(None, _raw()).model
    predicted = predicted_model_state_bytes(m, CASE.mesh_shape)
    assert [r["states"] for r in runs["built"]] == [predicted] * 4


def test_training_equals_one_process(runs):
    one, four = runs["one"][0], runs["four"][0]
    assert len(one) == len(four) == STEPS
    assert max(abs(a - b) for a, b in zip(one, four)) < TOL, (one, four)
