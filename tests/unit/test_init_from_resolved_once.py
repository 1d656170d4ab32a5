"""model.init_from naming a `<run>/checkpoints` directory names its latest step, which moves on while that run
saves. Each rank resolved it as it loaded its shards (train/weights.py load_weights), so a save landing between
two ranks' reads filled one model with shards of two steps, without a word. It is resolved once, on rank 0, and
every rank reads that step. Emulated on 2 gloo ranks: rank 1's resolution sees a newer step than rank 0's."""

from pathlib import Path

from longctx.job.spawn import run_spawned


class _Model:
    def set_router_step(self, step):
        pass


def _load_on_rank(source):
    import torch.distributed as dist

    import longctx.train.weights as weights
    from longctx.config import load_config
    from longctx.job.runtime import Runtime

    rank = dist.get_rank()
    rt = Runtime.create(load_config(None, ["--parallel.dp_shard=2"]), rank, 2, "cpu")
    read = []
    # (what each rank would see: rank 1 resolves after the source run saved step 2)
    weights.resolve_checkpoint = lambda src, path: Path(src) / f"step-0000000{rank + 1}"
    weights.load_weights_into = lambda path, model, rt, log, flag: read.append(str(path))
    weights.read_manifest = lambda path: {"step": 1}
    returned = weights.load_weights(_Model(), source, rt, log=lambda *a: None)
    return read, str(returned)


def test_every_rank_reads_the_step_rank_0_resolved(tmp_path):
    source = str(tmp_path / "checkpoints")
    results = run_spawned(2, _load_on_rank, source)
    first = str(Path(source) / "step-00000001")
    assert results == [([first], first), ([first], first)]


def _generate_load_on_rank(source):
    import dataclasses

    import torch
    import torch.distributed as dist

    import longctx.checkpoint.manager as manager
    import longctx.checkpoint.weights_only as weights_only
    from longctx.config import load_config
    from longctx.generate.loading import load_model

    rank = dist.get_rank()
    read = []
    manager.resolve_checkpoint = lambda src, path: Path(src) / f"step-0000000{rank + 1}"
    weights_only.load_model_weights = lambda path, model: read.append(str(path)) or {"step": 1}
    cfg = load_config(None, ["--model.layers=1"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=source))
    load_model(cfg, torch.device("cpu"), torch.float32)
    return read


def test_generate_and_eval_ranks_load_the_step_rank_0_resolved(tmp_path):
    """generate/eval --checkpoint <run>/checkpoints on head x ctx ranks (generate/loading.py load_model): a run in
    progress saving between the ranks' reads gave each rank another step, their cache shards two models."""
    source = str(tmp_path / "checkpoints")
    first = str(Path(source) / "step-00000001")
    assert run_spawned(2, _generate_load_on_rank, source) == [[first], [first]]
