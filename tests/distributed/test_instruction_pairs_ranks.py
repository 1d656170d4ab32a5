"""A store of instruction pairs (data build --response-field: only the responses trained on) under sequence
and data parallelism (2 gloo ranks): each rank reads its share of the positions and their labels from the
store, the prompts' labels ignored on every rank, and the per-step losses are one process's (fp32)."""

import json

import pytest

from longctx.config import load_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.job.spawn import run_spawned_many

SEQ = 256
ARGS = [f"--train.seq_len={SEQ}", "--train.global_batch=4", "--train.steps=3", "--train.warmup_steps=1",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=2",
        "--train.eval_interval=0", "--checkpoint.final=false"]
LAYOUTS = {"ctx2": ["--parallel.ctx=2"], "dp2": []}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairs_ranks")
    with open(tmp / "pairs.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"prompt": f"Note {i}: the value is {i * 7 % 100}.\n" * (1 + i % 4) + "Value?",
                                "response": f" {i * 7 % 100}."}) + "\n")
    build_store(BuildOptions([str(tmp / "pairs.jsonl")], str(tmp / "store"), SEQ, strategy="bfd", dedup="none",
                             workers=1, eval_fraction=0.0, progress=False, stats=False, text_field="prompt",
                             response_field="response"), log=lambda *a: None)
    return str(tmp / "store")


def _train(args, run_dir):
    """The losses, and each step's label count (the loss's normaliser)."""
    from longctx.train.trainer import Trainer

    trainer = Trainer(load_config(None, [*ARGS, *args, f"--train.run_dir={run_dir}"]), log=lambda *a, **k: None)
    counts, read_local = [], trainer.sampler.read_local

    def recording(samples, indices):
        share, valid = read_local(samples, indices)
        counts.append(valid)
        return share, valid

    trainer.sampler.read_local = recording
    return trainer.run().losses, counts


def test_pairs_train_as_one_process_under_sequence_and_data_parallelism(store, tmp_path):
    single, single_counts = _train([f"--data.path={store}"], str(tmp_path / "single"))
    jobs = [(name, _train, ([f"--data.path={store}", *args], str(tmp_path / name))) for name, args in LAYOUTS.items()]
    ranks = run_spawned_many(2, jobs)
    # the normaliser is the responses' labels alone: a few tokens of each 4-document sample
    assert 0 < max(single_counts) < 4 * SEQ // 4
    for name in LAYOUTS:
        for losses, counts in ranks[name]:
            assert counts == single_counts, name
            assert max(abs(a - b) for a, b in zip(losses, single, strict=True)) <= 1e-5, (name, losses, single)
