"""A checkpoint of another MoE structure is refused by the manifest's model check, naming what differs,
before anything is loaded (docs/checkpoints.md: "one from another model shape is refused before
anything is loaded"). The check compared only the dense shape fields: an MoE checkpoint resumed with
another number of experts, expert width, shared experts or dense layers, or into a dense model, got
as far as DCP, which stopped with a size-mismatch or missing-key traceback from inside its planner."""

import pytest

from longctx.checkpoint.manifest import check_model_matches
from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.config.load import to_dict


def _model(*args) -> dict:
    return to_dict(load_config(None, ["--model.preset=debug-moe", *args]))["model"]


SAVED = {"model": _model()}


def test_the_same_structure_and_routing_changes_pass():
    check_model_matches(SAVED, _model(), "ck")
    check_model_matches(SAVED, _model("--model.moe.dense_layers=0-0"), "ck")  # the same layers, written otherwise
    check_model_matches(SAVED, _model("--model.moe.expert_dim=128"), "ck")  # the preset's own width, given
    check_model_matches(SAVED, _model("--model.moe.top_k=1"), "ck")  # no parameter changes (config/resume.py's)
    dense = {"model": to_dict(load_config(None, ["--model.preset=debug"]))["model"]}
    check_model_matches(dense, to_dict(load_config(None, ["--model.preset=debug"]))["model"], "ck")


@pytest.mark.parametrize("args, said", [
    (["--model.moe.experts=4"], "moe.experts 8 in the checkpoint vs 4"),
    (["--model.moe.expert_dim=64"], "moe.expert_dim 128 in the checkpoint vs 64"),
    (["--model.moe.shared_experts=1"], "moe.shared_experts 0 in the checkpoint vs 1"),
    (["--model.moe.dense_layers=0,1"], r"moe layers \[1, 2, 3\] in the checkpoint vs \[2, 3\]"),
    (["--model.preset=debug"], "moe.experts 8 in the checkpoint vs 0"),
])
def test_another_moe_structure_is_refused_naming_it(args, said):
    with pytest.raises(CheckpointError, match=said):
        check_model_matches(SAVED, _model(*args), "ck")


def test_rank_state_is_read_back_only_under_the_same_expert_degree(tmp_path):
    """A rank's own state (co2's outer state: its parameter shards) follows the sharding, which the expert
    degree changes; the layout names it, and a checkpoint written before it did counts as expert 1."""
    import torch

    from longctx.checkpoint.manager import CheckpointManager, local_state_file

    (tmp_path / local_state_file(0)).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"co2": 1}, tmp_path / local_state_file(0))
    old = {"layout": {"world": 4, "dp_replicate": 2}}  # (no expert key: written before it was named)

    def reader(expert):
        return CheckpointManager(tmp_path / "ckpts", keep=1, async_save=False, rank=0, world=1,
                                 layout={"world": 4, "dp_replicate": 2, "expert": expert}, model_cfg={}, log=print)

    assert reader(1).load_rank_state(tmp_path, old) == {"co2": 1}
    assert reader(2).load_rank_state(tmp_path, old) is None
    assert reader(2).load_rank_state(tmp_path, {"layout": {"world": 4, "dp_replicate": 2, "expert": 2}}) == {"co2": 1}
