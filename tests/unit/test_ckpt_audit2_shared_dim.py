"""A checkpoint whose shared expert is sized by model.moe.shared_dim alone (moe.shared_experts 0: the model
builds one SwiGLU of that width, ModelConfig.resolved_shared_dim) is compared by that width. The structure check
counted a shared expert only from moe.shared_experts, so a checkpoint of shared_dim 48 resumed (or loaded by
model.init_from, eval, export) into shared_dim 32, or into none, passed it and stopped inside DCP's planner with
a size-mismatch or missing-key traceback, the exact failure config/weight_shapes.py is there to prevent."""

import pytest

from longctx.checkpoint.manifest import check_model_matches
from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.config.load import to_dict

BASE = ["--model.preset=debug-moe", "--model.family=qwen2_moe", "--model.qkv_bias=true"]


def _model(*args) -> dict:
    return to_dict(load_config(None, [*BASE, *args]))["model"]


SAVED = {"model": _model("--model.moe.shared_dim=48", "--model.moe.shared_gate=true")}


def test_the_same_shared_expert_passes():
    check_model_matches(SAVED, _model("--model.moe.shared_dim=48", "--model.moe.shared_gate=true"), "ck")


@pytest.mark.parametrize("args, said", [
    (["--model.moe.shared_dim=32", "--model.moe.shared_gate=true"], "moe.shared_dim 48 in the checkpoint vs 32"),
    ([], "moe.shared_dim 48 in the checkpoint vs 0"),
    (["--model.moe.shared_dim=48"], "moe.shared_gate True in the checkpoint vs False"),
])
def test_another_shared_expert_width_or_gate_is_refused_naming_it(args, said):
    with pytest.raises(CheckpointError, match=said):
        check_model_matches(SAVED, _model(*args), "ck")
