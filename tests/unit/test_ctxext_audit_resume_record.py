"""A resumed extension run records what its own weights trained on, not what its init_from names now.

An extension run starts from `model.init_from = <pretraining run>/checkpoints` (configs/extend.toml): the
latest checkpoint there. Its resume re-read that directory for the start's reach, max'd with the resumed
checkpoint's record; when the pretraining run had gone on meanwhile (a longer stage), its new latest
checkpoint's trained_positions, positions these weights never saw, went into every later checkpoint of the
extension run, and `longctx generate` trusted it with them silently. The resumed checkpoint's record already
holds its start's reach (the trainer records max(start, stages)): that is the one to keep."""

import json

from longctx.config import load_config
from longctx.config.positions import model_reach
from longctx.config.resume import load_run_config
from longctx.train.trainer import Trainer

_RUN = ["--train.warmup_steps=1", "--train.eval_interval=0", "--data.max_docs=40", "--metrics.progress=false",
        "--metrics.plots=false", "--model.layers=1", "--model.dim=32", "--model.ffn_dim=64", "--model.heads=2",
        "--model.kv_heads=2", "--train.global_batch=2", "--checkpoint.interval=2", "--data.tokenizer=byte",
        "--model.max_seq_len=512"]


def _quiet(*_args, **_kwargs):
    pass


def _resume(run_dir, *overrides):
    cfg, _ = load_run_config(None, [f"--train.run_dir={run_dir}", "--checkpoint.resume=auto", *overrides], False)
    Trainer(cfg, log=_quiet).run()


def _records(run_dir) -> list[int]:
    return [json.loads((step / "manifest.json").read_text())["trained_positions"]
            for step in sorted((run_dir / "checkpoints").glob("step-*"))]


def test_a_resumed_extension_keeps_its_own_reach_when_its_init_from_moved_on(tmp_path):
    pretrain, extend = tmp_path / "pretrain", tmp_path / "extend"
    Trainer(load_config(overrides=[*_RUN, f"--train.run_dir={pretrain}", "--train.seq_len=64", "--train.steps=2"]),
            log=_quiet).run()
    yarn = ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=64"]
    start = f"--model.init_from={pretrain}/checkpoints"  # (its latest checkpoint, as configs/extend.toml names it)
    Trainer(load_config(overrides=[*_RUN, *yarn, f"--train.run_dir={extend}", start, "--train.seq_len=128",
                                   "--train.steps=2"]), log=_quiet).run()
    assert _records(extend) == [256]  # 64 x 4 from its start, past the 128 it trained at
    _resume(pretrain, "--train.steps=4", "--train.stages=64:2,512:2")  # the pretraining run goes on, at 512
    assert _records(pretrain) == [64, 512]
    _resume(extend, "--train.steps=4")
    assert _records(extend) == [256, 256]  # (was [256, 512]: the pretraining run's new checkpoint's)
    reach = model_reach(load_config(overrides=[f"--model.init_from={extend}/checkpoints", "--train.seq_len=64"]).model)
    assert reach.positions == 256
