"""generate/eval/bench decode --checkpoint on head x ctx ranks resolve a checkpoints directory once, on rank 0
(generate/loading.py load_model). Where rank 0's resolution fails (the directory emptied by another run's keep,
an unreadable disk), its error reaches every rank, as train/setup.py on_main passes it: the other ranks had
waited in the broadcast for a result that never came, until the process group's timeout."""

import dataclasses
from pathlib import Path

from longctx.job.spawn import run_spawned


def _load_where_rank_0_fails(source):
    import torch
    import torch.distributed as dist

    import longctx.checkpoint.manager as manager
    from longctx.config import load_config
    from longctx.config.checkpoint_paths import CheckpointError
    from longctx.generate.loading import load_model

    rank = dist.get_rank()

    def resolve(src, path):
        if rank == 0:
            raise CheckpointError(f"--checkpoint {src}: no complete checkpoint there")
        return Path(src) / "step-00000001"

    manager.resolve_checkpoint = resolve
    cfg = load_config(None, ["--model.layers=1"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=source))
    try:
        load_model(cfg, torch.device("cpu"), torch.float32)
    except Exception as e:  # noqa: BLE001 (each rank reports what it raised)
        return type(e).__name__, "no complete checkpoint" in str(e)
    return "loaded", False


def test_rank_0_failing_to_resolve_fails_every_rank(tmp_path):
    results = run_spawned(2, _load_where_rank_0_fails, str(tmp_path / "checkpoints"), timeout=90)
    assert results == [("CheckpointError", True), ("CheckpointError", True)]
