"""Checkpoints of MoE runs under expert parallelism with FlexMoE's copies (parallel.expert_replicas) and under
hierarchical dispatch (parallel.expert_ranks_per_node), end to end on 2 gloo ranks (debug-moe written as a
qwen3_moe, so that it exports):

- saved in the middle of a placement window (window 3, saved at step 2) and resumed, steps 3-6 are the
  uninterrupted run's (placements and the window's counts restored; copies run steps 4-6, so the losses of
  steps 5-6 hold updates whose gradients went through them);
- resumed without copies and expert parallelism (expert 2 -> 1, replicas 1 -> 0; dp 2 and one process), the
  next steps are the uninterrupted run's: the checkpoint holds each expert once, the owner's weights;
- `longctx checkpoint export --to hf` writes each expert once and transformers' logits are longctx's;
- a hierarchical run's checkpoint holds the same tensors under the same names, and resumes flat;
- `longctx checkpoint verify` of such a checkpoint whose shard was deleted or truncated refuses it, naming it.
"""

import sys
from pathlib import Path

import pytest
import torch
from test_training_parity import BASE

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_newcomer import longctx_here  # noqa: E402

MOE = [*BASE, "--train.seq_len=64", "--model.preset=debug-moe", "--model.family=qwen3_moe", "--model.qk_norm=true",
       "--train.steps=6", "--checkpoint.interval=2", "--checkpoint.keep=3", "--metrics.log_interval=1",
       "--data.tokenizer=byte"]
COPIES = ["--parallel.expert=2", "--parallel.expert_replicas=1", "--parallel.expert_placement_window=3"]
HIER = ["--parallel.expert=2", "--parallel.expert_ranks_per_node=1"]
PLAIN = ["--parallel.expert=1", "--parallel.expert_replicas=0"]


def _train(args, run_dir, resume=None):
    """(losses, the placement log lines, whether copies are in use at the end, the resume's log line)."""
    from longctx.models.moe import moe_layers
    from longctx.train.trainer import Trainer

    extra = [] if resume is None else [f"--checkpoint.resume={resume}"]
    lines = []
    cfg = load_config("configs/debug.toml", [*MOE, *args, *extra, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    losses = trainer.run().losses
    copies = any(getattr(m.experts, "placement", None) is not None and m.experts.placement.copies > 0
                 for m in moe_layers(trainer.model))
    resumed = [x for x in lines if x.startswith("checkpoint: resumed step")]
    return losses, [x for x in lines if "expert placement" in x], copies, resumed


def _step(run_dir, step):
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moeckpt108")
    whole, hier = base / "whole", base / "hier"
    jobs = [("whole", _train, ([*COPIES, "--checkpoint.async=true"], str(whole))),  # (a background save)
            ("resumed", _train, (COPIES, str(base / "resumed"), str(_step(whole, 2)))),
            ("dp2", _train, (PLAIN, str(base / "dp2"), str(_step(whole, 2)))),
            ("hier", _train, (HIER, str(hier))),
            ("hier-flat", _train, (COPIES, str(base / "hier-flat"), str(_step(hier, 2))))]
    out = run_spawned_many(2, jobs)
    single = _train(PLAIN, str(base / "single"), str(_step(whole, 2)))
    return base, {k: v[0] for k, v in out.items()}, single


def test_resumed_mid_window_and_resharded_runs_train_as_the_uninterrupted_one(runs):
    _, out, single = runs
    losses, lines, copies, _ = out["whole"]
    assert copies and len(lines) == 1, lines  # placed before step 4 (from steps 1-3): copies in use
    for key, other in (("resumed", out["resumed"][0]), ("dp2", out["dp2"][0]), ("single", single[0])):
        diff = max(abs(a - b) for a, b in zip(other, losses[2:], strict=True))
        print(f"{key} from step 2 vs uninterrupted, steps 3-6: max |loss diff| {diff:.2e}")
        # (4.8e-7 measured for one process; 3.6e-4 with the copies' gradients kept from their owners)
        assert diff <= 1e-6, (key, other, losses)
    assert out["resumed"][1] == lines  # the resumed run re-places before step 4 from the same counts
    # the resume says the expert degree it was written under and the one it goes on with
    assert out["dp2"][3][0].endswith("(written by 2 ranks: dp_replicate 1 x dp_shard 2 x head 1 x ctx 1, head-first "
                                     "(expert 2 folded over them); now 2 ranks: dp_replicate 1 x dp_shard 2 x head 1 "
                                     "x ctx 1, head-first)"), out["dp2"][3]
    assert single[3][0].endswith("(expert 2 folded over them); now 1 process)"), single[3]


def test_the_checkpoint_holds_each_expert_once(runs):
    """The saved tensors are one process's (global [E, ...] expert weights, no copy slots beside them)."""
    from torch.distributed.checkpoint import FileSystemReader

    from longctx.models.llama import build_model

    base, _, _ = runs
    path = _step(base / "whole", 4)
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in
             FileSystemReader(str(path)).read_metadata().state_dict_metadata.items() if k.startswith("model.")}
    model = build_model(load_config(path.parents[1] / "config.toml").model, seed=None)
    assert saved == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert saved["layers.1.feed_forward.experts.w1"][0] == 8, saved


def _tensors(path):
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.models.llama import build_model

    model = build_model(load_config(path.parents[1] / "config.toml").model, seed=None)
    load_model_weights(path, model)
    return model


def test_a_hierarchical_checkpoint_holds_what_a_flat_one_does(runs):
    base, out, _ = runs
    flat, hier = _tensors(_step(base / "whole", 2)).state_dict(), _tensors(_step(base / "hier", 2)).state_dict()
    assert flat.keys() == hier.keys() and all(flat[k].shape == hier[k].shape for k in flat)
    diff = max((flat[k] - hier[k]).abs().max().item() for k in flat)
    print(f"hierarchical vs flat checkpoint at step 2: max |weight diff| {diff:.2e}")
    assert diff <= 1e-5
    # resumed flat with copies (placed before step 4 from step 3's counts alone: the hierarchical run kept none)
    diff = max(abs(a - b) for a, b in zip(out["hier-flat"][0], out["hier"][0][2:], strict=True))
    print(f"hierarchical checkpoint resumed flat with copies vs the hierarchical run, steps 3-6: {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("run", ["whole", "hier"])
def test_the_export_holds_each_expert_once_and_gives_longctx_logits(runs, run, tmp_path):
    from safetensors import safe_open

    base, _, _ = runs
    path = _step(base / run, 6)
    r = longctx_here("checkpoint", "export", str(path), str(tmp_path / "hf"), "--to", "hf")
    assert r.returncode == 0, r.stderr
    names = []
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            names += list(s.keys())
    experts = [n for n in names if ".experts." in n]
    assert len(names) == len(set(names)) and len(experts) == 3 * 8 * 3, experts  # 3 MoE layers x 8 x 3
    ours = _tensors(path).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    t = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ours(t) - theirs(t).logits).abs().max().item()
    print(f"export of {run}: max |logits diff| {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_verify_export_and_resume_refuse_a_checkpoint_missing_an_expert_shard(runs, damage, tmp_path):
    """Rank 1's file holds experts 4-7 (its Shard(0) half of every expert weight)."""
    import shutil

    from longctx.config.checkpoint_paths import CheckpointError

    base, _, _ = runs
    path = tmp_path / "run" / "checkpoints" / "step-00000006"
    shutil.copytree(_step(base / "whole", 6), path)
    shutil.copy(base / "whole" / "config.toml", tmp_path / "run" / "config.toml")
    shard = path / "__1_0.distcp"
    if damage == "deleted":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = longctx_here("checkpoint", "verify", str(path))
    print(r.stdout, r.stderr)
    said = "is missing" if damage == "deleted" else "truncated or overwritten"
    assert r.returncode != 0 and "DAMAGED  __1_0.distcp" in r.stdout and said in r.stdout
    assert "2 ranks: dp_replicate 1 x dp_shard 2 x head 1 x ctx 1, head-first (expert 2 folded over them)" in r.stdout
    r = longctx_here("checkpoint", "export", str(path), str(tmp_path / "hf"), "--to", "hf")
    assert r.returncode != 0 and "__1_0.distcp" in r.stderr and not (tmp_path / "hf").exists(), r.stderr
    with pytest.raises(CheckpointError, match=r"is damaged: .*__1_0\.distcp"):
        _train(PLAIN, str(tmp_path / "resumed"), str(path))
