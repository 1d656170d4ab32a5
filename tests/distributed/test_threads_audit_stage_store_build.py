"""A staged run built each later stage's default store when the stage began (torchrun straight, without
`longctx train --nproc`'s preflight, which builds them first): rank 0 built while the other ranks waited in a
broadcast, under the hang watchdog, so a build longer than parallel.timeout_s ended the job as hung (exit 86)
hours into training. The Trainer now builds them at set-up, before the watchdog runs. 2 gloo ranks; the build
of stage 2's store is made slow (8 s, over parallel.timeout_s = 3) once, then it is cached."""

import time

from longctx.job.spawn import run_spawned


def _rank(run_dir: str) -> tuple[int, int]:
    from longctx.config import load_config
    from longctx.train import setup
    from longctx.train.trainer import Trainer

    build, built = setup.default_store, []

    def slow_build(data_cfg, seq_len, *args, **kwargs):
        if seq_len == 128 and not built:
            built.append(seq_len)
            time.sleep(8.0)
        return build(data_cfg, seq_len, *args, **kwargs)

    setup.default_store = slow_build
    cfg = load_config(None, ["--train.stages=64:2,128:2", "--train.global_batch=2", "--data.max_docs=40",
                             "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                             "--train.device=cpu", "--model.layers=1", "--parallel.timeout_s=3",
                             "--checkpoint.final=false", f"--train.run_dir={run_dir}"])
    return len(Trainer(cfg, log=lambda *a, **k: None).run().losses), len(built)


def test_a_later_stages_slow_store_build_does_not_trip_the_hang_watchdog(tmp_path):
    results = run_spawned(2, _rank, str(tmp_path / "run"), timeout=300)
    assert [steps for steps, _ in results] == [4, 4]
    assert results[0][1] == 1  # rank 0 built stage 2's store (once)
