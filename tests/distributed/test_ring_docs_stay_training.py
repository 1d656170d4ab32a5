"""The training loop on documents that each stay on one context rank (ctx 2, 2 gloo ranks): the ring is
skipped (every ring attention call runs local, parallel/context/ring.py) and the losses still match the
single process's. 64-token documents (63 bytes and the EOS, byte tokenizer) in 256-token samples: every
document lies inside one of ctx 2's 64-token zigzag chunks, and the document split keeps them whole."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned
from longctx.train.trainer import train

STEPS = 2
BASE = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=0",
        "--train.seq_len=256", "--train.warmup_steps=1", f"--train.steps={STEPS}", "--data.tokenizer=byte"]


def _train(args, run_dir, record=False):
    from longctx.parallel.context import ring

    calls = []
    if record:  # every ring call's `local` (the skip), read where the ring runs
        inner = ring.ring_forward

        def recording(*a, **k):
            calls.append(bool(a[9] if len(a) > 9 else k.get("local", False)))
            return inner(*a, **k)

        ring.ring_forward = recording
    try:
        cfg = load_config("configs/debug.toml", [*args, f"--train.run_dir={run_dir}"])
        return train(cfg, log=lambda *a, **k: None).losses, calls
    finally:
        if record:
            ring.ring_forward = inner


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import random

    d = tmp_path_factory.mktemp("docs64")
    rng = random.Random(0)
    for i in range(200):
        text = "".join(rng.choice("abcdefgh ") for _ in range(62)) + "\n"  # 63 bytes + EOS = 64 tokens
        (d / f"doc{i:04d}.txt").write_text(text)
    return str(d)


@pytest.mark.parametrize("balance", ["docs", "zigzag"])
def test_skipped_ring_trains_like_one_process(corpus, balance, tmp_path):
    args = [*BASE, f"--data.corpus={corpus}", f"--parallel.seq_balance={balance}"]
    single, _ = _train(args, str(tmp_path / "single"))
    ranks = run_spawned(2, _train, [*args, "--parallel.ctx=2"], str(tmp_path / "ctx2"), True)
    for losses, calls in ranks:
        assert calls and all(calls), f"ring calls that ran the ring: {calls.count(False)} of {len(calls)}"
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, single)) <= 1e-5, (losses, single)
