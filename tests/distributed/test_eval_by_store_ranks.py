"""Each store's eval loss over a mix (train/evaluation.py) under 2 gloo ranks: data parallel (each rank its rows)
and context parallel (each rank a part of every row, grad_accum 2) give one process's per-store losses."""

import random

import pytest

from longctx.config import load_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.job.spawn import run_spawned_many

SEQ = 64
ARGS = [f"--train.seq_len={SEQ}", "--train.global_batch=4", "--train.steps=3", "--train.warmup_steps=1",
        "--train.lr=3e-3", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--train.eval_interval=3", "--train.eval_batches=3", "--data.weights=0.7,0.3"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Repetitive text and varied text: their losses differ, so a row scored into the wrong store would show."""
    tmp = tmp_path_factory.mktemp("eval_by_store_ranks")
    out = []
    for name, alphabet in (("books", "aaaa "), ("code", "qwertyuiopzxcvbnm0123456789{}();")):
        src = tmp / f"in-{name}"
        src.mkdir()
        rng = random.Random(name)
        for i in range(40):
            (src / f"{i:03d}.txt").write_text("".join(rng.choice(alphabet) for _ in range(rng.randint(40, 90))))
        build_store(BuildOptions([str(src)], str(tmp / name), SEQ, strategy="bfd", dedup="none", workers=1,
                                 eval_fraction=0.4, progress=False, stats=False), log=lambda *a: None)
        out.append(str(tmp / name))
    return ",".join(out)


def _evals(paths: str, run_dir: str, extra: list[str]):
    """The per-store losses at the start and after the run's steps, and the blend's after."""
    from longctx.train.trainer import Trainer

    cfg = load_config(None, [*ARGS, *extra, f"--data.path={paths}", f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.evaluate()
    before = trainer.last_eval.by_store
    result = trainer.run()
    return before, result.eval_by_store[3], result.eval_losses[3]


def test_per_store_eval_losses_are_one_process_under_data_and_context_parallel(stores, tmp_path):
    ref_before, ref_after, ref_blend = _evals(stores, str(tmp_path / "one"), [])
    assert ref_after["books"] < ref_after["code"] - 0.3, ref_after
    layouts = {"dp2": [], "ctx2-ga2": ["--parallel.ctx=2", "--train.grad_accum=2"]}
    runs = run_spawned_many(2, [(name, _evals, (stores, str(tmp_path / name), extra))
                                for name, extra in layouts.items()])
    for name in layouts:
        assert len(runs[name]) == 2
        for before, after, blend in runs[name]:
            assert abs(blend - ref_blend) <= 1e-5, (name, blend, ref_blend)
            for store in ref_after:
                assert abs(before[store] - ref_before[store]) <= 1e-5, (name, store, before, ref_before)
                assert abs(after[store] - ref_after[store]) <= 1e-5, (name, store, after, ref_after)
