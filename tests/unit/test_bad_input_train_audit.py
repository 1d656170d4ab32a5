"""`longctx train` fed the inputs a user gets wrong: each is one clear error before any work.

Found by running the CLI on ~130 bad inputs (badtrain audit). Accepted, then crashed deep in the
work: a negative train.seed (numpy's generator, at the first step); a file where the run directory,
the checkpoint directory or the metrics file's directory should be, or a directory as
metrics.file (a raw FileExistsError / IsADirectoryError once the model was built). Accepted and
silently did nothing: an offload that no block takes and memory.expert_chunk on a dense model (now
refused), [model.moe] keys on a dense model (now a note on the setup line)."""

import copy
import functools

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError, UserError
from longctx.train.preflight import preflight


def refused(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=list(overrides))
    return " ".join(str(e.value).split())


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_a_seed_out_of_range_is_refused_at_load(seed):
    # numpy's default_rng refuses a negative seed (the data order), and torch one of 2**64 or more
    np = pytest.importorskip("numpy")
    if int(seed) < 0:
        with pytest.raises(ValueError):
            np.random.default_rng([int(seed), 0])
    msg = refused(f"--train.seed={seed}")
    if int(seed) < 0:
        assert "train.seed must be a whole number from 0 to 2**63 - 1" in msg and f"got {seed}" in msg
    else:  # (past a TOML integer, refused as every int key's is: config/fields.py)
        assert f"train.seed = {seed} is past a TOML integer's range, -2**63 to 2**63 - 1" in msg
    assert load_config(overrides=[f"--train.seed={2**63 - 1}"]).train.seed == 2**63 - 1


def _offloaded_blocks(skip_last: int, fraction: float = 0.5) -> int:
    """How many blocks apply_memory_policy really offloads (the work's own answer, not the rule's)."""
    from longctx.memory.apply_policy import _offload_forward, apply_memory_policy
    from longctx.models.llama import build_model

    model = build_model(load_config(overrides=[]).model, seed=0)
    layers = copy.deepcopy(model).layers
    apply_memory_policy(layers, "selective", fraction, offload_skip_last=skip_last)
    return sum(isinstance(b.forward, functools.partial) and b.forward.func is _offload_forward for b in layers)


@pytest.mark.parametrize("fraction", ["0.5", "auto"])
def test_an_offload_that_no_block_takes_is_refused(fraction):
    assert _offloaded_blocks(4) == 0 and _offloaded_blocks(3) == 1  # the debug model has 4 blocks
    msg = refused("--memory.recompute=selective", f"--memory.offload_fraction={fraction}",
                  "--memory.offload_skip_last=4")
    assert f"memory.offload_fraction = {fraction} would offload nothing" in msg
    assert "Set memory.offload_skip_last below 4" in msg
    load_config(overrides=["--memory.recompute=selective", f"--memory.offload_fraction={fraction}",
                           "--memory.offload_skip_last=3"])  # one block offloaded: fine


def test_a_one_block_model_with_the_default_skip_last_offloads_nothing():
    msg = refused("--model.layers=1", "--memory.recompute=full", "--memory.offload_fraction=1.0")
    assert "would offload nothing" in msg and "(e.g. 0)" in msg


@pytest.mark.parametrize("args,named", [
    (["--model.moe.top_k=4"], "model.moe.top_k = 4 is"),
    (["--model.moe.router=sigmoid", "--model.moe.capacity_factor=1.25"],
     "model.moe.router = 'sigmoid', model.moe.capacity_factor = 1.25 are"),
    (["--model.moe.aux_loss=0.01"], "model.moe.aux_loss = 0.01 is"),
])
def test_moe_keys_on_a_dense_model_are_named_in_the_setup_notes(args, named):
    """A note, not an error: a MoE run's saved config.toml under a dense --model.preset keeps the keys it
    changed (test_config_audit.py), and that is allowed; but the run says they do nothing."""
    from longctx.config.moe_rules import moe_notes

    [note] = moe_notes(load_config(overrides=args).model)
    assert f"{named} ignored: the model is dense (model.moe.experts = 0, model.preset debug)" in note
    assert "--model.preset debug-moe" in note
    assert moe_notes(load_config(overrides=["--model.preset=debug-moe", *args]).model) == []  # on MoE they apply
    # a MoE preset with its experts off keeps the preset's [model.moe] values, not the user's: no note
    off = load_config(overrides=["--model.preset=debug-moe", "--model.moe.experts=0"]).model
    assert not off.is_moe and moe_notes(off) == []


def test_expert_chunk_on_a_dense_model_is_refused():
    msg = refused("--memory.expert_chunk=16")
    assert "memory.expert_chunk = 16 would be ignored" in msg and "the model is dense" in msg
    assert load_config(overrides=["--model.preset=debug-moe", "--memory.expert_chunk=16"]).memory.expert_chunk == 16


def _preflight(tmp_path, *overrides):
    # a store that does not exist: the paths are checked before the data, so no store is built
    cfg = load_config(overrides=["--train.seq_len=64", f"--data.path={tmp_path / 'no-store'}", *overrides])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, 1, log=lambda *a: None)
    return " ".join(str(e.value).split())


@pytest.mark.parametrize("key,below", [("train.run_dir", ""), ("train.run_dir", "run"), ("checkpoint.dir", ""),
                                       ("metrics.file", "metrics.jsonl")])
def test_a_file_where_the_run_writes_a_directory_is_refused_before_work(tmp_path, key, below):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    given = blocker / below if below else blocker
    run_dir = tmp_path / "run"
    extra = [] if key == "train.run_dir" else [f"--train.run_dir={run_dir}"]
    msg = _preflight(tmp_path, f"--{key}={given}", *extra)
    assert f"{key} {given}: the run writes into the directory" in msg and f"but {blocker} is a file" in msg
    assert not run_dir.exists()


def test_a_directory_as_the_metrics_file_is_refused_before_work(tmp_path):
    run_dir = tmp_path / "run"
    msg = _preflight(tmp_path, f"--metrics.file={tmp_path}", f"--train.run_dir={run_dir}")
    assert f"metrics.file {tmp_path} is a directory" in msg and "metrics.jsonl" in msg
    assert not run_dir.exists()


def test_a_checkpoint_dir_holding_another_runs_checkpoints_is_refused_before_work(tmp_path):
    """A new run saving into it replaced the other run's step directories of the same numbers, pruned its
    older ones and moved its `latest` (that run's resume then met this run's model)."""
    shared = tmp_path / "shared"
    (shared / "step-00000003").mkdir(parents=True)
    (shared / "step-00000003" / "manifest.json").write_text("{}")  # (complete: what complete_checkpoints asks)
    run_dir = tmp_path / "new"
    msg = _preflight(tmp_path, f"--checkpoint.dir={shared}", f"--train.run_dir={run_dir}")
    assert f"the checkpoint directory {shared} already holds 1 checkpoint(s) of another run" in msg
    assert "step-00000003" in msg and "--checkpoint.resume auto" in msg and "Nothing was changed" in msg
    assert not run_dir.exists() and sorted(p.name for p in shared.iterdir()) == ["step-00000003"]
    # a run that saves nothing writes nothing there: the data store is what it hears about
    cfg = load_config(overrides=["--train.seq_len=64", f"--data.path={tmp_path / 'no-store'}",
                                 "--checkpoint.final=false", f"--checkpoint.dir={shared}",
                                 f"--train.run_dir={run_dir}"])
    with pytest.raises(UserError, match="is not a longctx data store"):
        preflight(cfg, 1, log=lambda *a: None)
