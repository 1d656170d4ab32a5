"""memory.model_states = host as a GPU would run it, on CPU: tests/host_origin.py tags every tensor with the memory
it would live in (FSDP2's CPU-offloaded shards, their gradients and AdamW moments in host memory; activations,
buffers and FSDP's gathered weights on the device) and records each operation that mixes the two, which a GPU
refuses. Two H200 runs failed so, each past what CPU tests could see: FSDP2's lazy init (parameters materialised
on the device, 6268f36) and train/read_back.py's torch.stack of the device loss and the host gradient norm
(7661cf6, which this test finds with the fix undone).

Covered, as a bf16 run on a GPU (bf16 autocast, FSDP gathering bf16, each MoE router a unit of its own gathered
in fp32): world 1 with MoE; world 2 with the experts' own mesh and ZeRO++'s quantised gathers and
reduce-scatters. In each: training steps with clipping, the guard (spike and non-finite), the optimizer's skip
flag, MoE router statistics and expert bias, evaluation, checkpoint saves, a resume, and a rollback to a
checkpoint. Also the waits a step makes for the device: a copy between the memories that is not non_blocking
drains the GPU's queue; in a step only the optimizer's skip flag needs one (the host's AdamW reads it) besides
FSDP's own gradient copies (non_blocking into pinned memory on CUDA)."""

import os

import pytest

from host_origin import HostOrigins, accelerator_device, tracking
from longctx.job.spawn import run_spawned_many

COMMON = ["--train.eval_batches=1", "--train.eval_interval=2", "--metrics.plots=false", "--metrics.progress=false",
          "--data.max_docs=300", "--train.seq_len=128", "--train.global_batch=2", "--metrics.log_interval=1",
          "--memory.model_states=host", "--checkpoint.interval=2", "--model.preset=debug-moe",
          "--train.on_nonfinite=rollback", "--train.spike_factor=3",
          "--train.dtype=bf16"]  # (bf16 autocast with the bf16 gathers below: a GPU's bf16 run)
# (the step's frames: an event within a step has _launch_step among its innermost longctx frames)
DEPTH = 12


def _runs(extra: list[str], run_dir: str) -> list[dict]:
    """Steps 1-3 (saves at 2 and 3), then a resume to step 6 whose step 5 is not finite (LONGCTX_FAULT):
    rolled back to the save at step 4. Each phase's events (kind, operation, where) but plain copies."""
    from longctx.config import load_config
    from longctx.train.trainer import Trainer

    phases, root = [], None
    for steps, fault in ((3, None), (6, "nonfinite@5")):
        resume = [f"--checkpoint.resume={root}"] if root else []
        cfg = load_config("configs/debug.toml", [*COMMON, f"--train.steps={steps}", f"--train.run_dir={run_dir}",
                                                 *extra, *resume])
        os.environ.pop("LONGCTX_FAULT", None)
        if fault:
            os.environ["LONGCTX_FAULT"] = fault
        origins = HostOrigins(depth=DEPTH)
        try:
            with accelerator_device(origins, bf16_gathers=True), tracking(origins):
                trainer = Trainer(cfg, log=lambda *a, **k: None)
                origins.tag_states(trainer.model, trainer.optimizer)
                result = trainer.run()
        finally:
            os.environ.pop("LONGCTX_FAULT", None)
        root = trainer.ckpt.root
        phases.append({"losses": result.losses, "rollbacks": trainer.rollbacks,
                       "events": [e for e in origins.events if e[0] not in ("h2d", "d2h")]})
    return phases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("host-origins")
    out = run_spawned_many(1, [("moe", _runs, ([], f"{base}/moe"))])
    out.update(run_spawned_many(2, [("experts-zero_pp", _runs, (
        ["--parallel.expert=2", "--parallel.zero_pp=qwz,qgz", "--parallel.ranks_per_node=1",
         "--parallel.zero_pp_block=32"], f"{base}/experts"))]))
    return {key: ranks[0] for key, ranks in out.items()}


@pytest.mark.parametrize("key", ["moe", "experts-zero_pp"])
def test_no_operation_mixes_host_and_device_tensors(runs, key):
    first, resumed = runs[key]
    assert len(first["losses"]) == 3 and resumed["rollbacks"] == 1  # (the paths ran)
    mixes = [e for phase in (first, resumed) for e in phase["events"] if e[0] == "mix"]
    assert not mixes, mixes


# what may wait for the device inside a step (the innermost longctx frame of the copy): the optimizer's skip flag
# (step/optimizer.py guarded_step: the host's AdamW reads it), and FSDP's gradient copies to host memory, issued in
# the backward (step_run.py's backward call; on CUDA non_blocking into pinned memory, but on the host's CPU here)
STEP_WAITS = ("step/optimizer.py", "train/step_run.py forward_backward")


def _innermost(where: str) -> str:
    frame = where.split(" < ")[0]  # "file:line function"
    return f"{frame.split(':')[0]} {frame.split(' ')[-1]}"


@pytest.mark.parametrize("key", ["moe", "experts-zero_pp"])
def test_a_step_waits_for_the_device_only_for_the_optimizers_flag(runs, key):
    waits = [(kind, op, where) for phase in runs[key] for kind, op, where in phase["events"]
             if kind.endswith("_sync") and "_launch_step" in where]
    assert any(_innermost(w[2]).startswith("step/optimizer.py") for w in waits)  # (the probe sees that one)
    unexpected = [w for w in waits if not _innermost(w[2]).startswith(STEP_WAITS)]
    assert not unexpected, unexpected
