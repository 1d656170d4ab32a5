"""train.compile under expert parallelism: a block's compiled `post` reaches the expert-parallel dispatcher,
whose exchange is driven by the host (counts read as split sizes, FlexMoE's slot order planned in Python,
the all-to-alls). Dynamo traced it: with a capacity and FlexMoE copies placed mid-run the second step
failed inside Dynamo's guards ("Guard failed on the same frame it was created") or sent all-to-all splits
that did not sum to its rows. The dispatcher's exchange now runs eagerly under compile
(parallel/expert/dispatch.py run_experts), and the compiled run trains as the eager one."""

import pytest
from test_training_parity import BASE, NO_SAVE

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many
from longctx.models.moe import moe_layers
from longctx.train.trainer import Trainer

STEPS = 3
ARGS = [*BASE, *NO_SAVE, "--model.preset=debug-moe", f"--train.steps={STEPS}", "--parallel.expert=2",
        "--model.moe.capacity_factor=1.0", "--parallel.expert_replicas=1", "--parallel.expert_placement_window=1"]


def _losses(args, run_dir):
    """The run's losses with expert 0 every token's first choice (a skew the copies take off its rank)."""
    cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    for layer in moe_layers(trainer.model):
        layer.router.expert_bias[0] = 10.0
    return trainer.run().losses


def test_a_compiled_expert_parallel_run_with_copies_and_a_capacity_trains_as_the_eager_one(tmp_path):
    out = run_spawned_many(2, [("eager", _losses, (ARGS, str(tmp_path / "eager"))),
                               ("compiled", _losses, ([*ARGS, "--train.compile=true"], str(tmp_path / "compiled")))])
    for eager, compiled in zip(out["eager"], out["compiled"], strict=True):
        assert compiled == pytest.approx(eager, abs=1e-5), (compiled, eager)
