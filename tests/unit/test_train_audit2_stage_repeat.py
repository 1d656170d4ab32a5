"""train.stages with two stages of one length (a batch ramp-up, "64:2:4,64:2:8", or a return to a length) read one
store. Each stage's order once started at that store's first sample, so the second stage trained on the first
stage's samples again, in the same order, with no word about it. A stage now goes on in its store's order where the
stages of its length before it left off: the run draws what one loader of that length would, and a resume at the
boundary draws the same."""

from longctx.config import load_config
from longctx.train.stages import StagedLoader
from longctx.train.trainer import Trainer
from simulated_crash import run_until_crash

BASE = ["--data.max_docs=40", "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
        "--model.layers=1", "--metrics.log_interval=1", "--train.eval_interval=0", "--train.warmup_steps=1"]


def _trainer(args: list[str]) -> tuple[Trainer, list]:
    """A Trainer whose drawn sample indices (one list per micro-batch) are recorded, step by step."""
    trainer = Trainer(load_config(None, [*BASE, *args]), log=lambda *a, **k: None)
    drawn, draw = [], trainer.sampler._draw

    def recording():
        drawn.append(draw())
        return drawn[-1]

    trainer.sampler._draw = recording
    return trainer, drawn


def test_a_second_stage_of_one_length_goes_on_in_its_stores_order(tmp_path):
    staged, drawn = _trainer([f"--train.run_dir={tmp_path / 'staged'}", "--train.stages=64:2:4,64:2:4"])
    staged.run()
    one, plain = _trainer([f"--train.run_dir={tmp_path / 'plain'}", "--train.steps=4", "--train.seq_len=64",
                           "--train.global_batch=4"])
    one.run()
    assert drawn[2:] != drawn[:2]  # (it repeated steps 1-2's samples)
    assert drawn == plain


def test_a_resume_at_the_boundary_draws_what_the_run_would(tmp_path):
    args = [f"--train.run_dir={tmp_path}", "--train.stages=64:2:4,128:1:2,64:2:8", "--checkpoint.interval=3"]
    whole, expected = _trainer([*args[1:], f"--train.run_dir={tmp_path / 'whole'}"])
    whole.run()
    crashed, _ = _trainer(args)
    run_until_crash(crashed, 4)
    resumed, drawn = _trainer([*args, "--checkpoint.resume=auto"])
    assert resumed.start_step == 3
    resumed.run()
    assert drawn == expected[3:]
    assert not set(sum(expected[3], [])) & set(sum(expected[0] + expected[1], []))


class _Store:
    """A store of `n` samples, never read (the loader only draws indices here)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_the_epochs_note_counts_what_the_stages_before_drew_from_the_store():
    """8 + 8 samples of one 10-sample store: stage 2 runs into its second epoch, and says so (alone, its 8 would
    be within one pass: it once said nothing, while repeating all of stage 1's 8)."""
    cfg = load_config(None, ["--train.stages=8:2:4,8:2:4", "--train.eval_interval=0"])
    said = []
    loader = StagedLoader(cfg, lambda c: (_Store(10), None), dp=1, log=said.append,
                          read_local=lambda samples, idx: (list(idx), len(idx)))
    drawn = [loader.step_batches(step) for step in range(1, 5) if loader.enter(step) or True]
    assert said == ["data: stage 2's 8 samples (after the 8 of the stages before it of this length) reach 1.60 epochs "
                    "of the store's 10 (each epoch reshuffled; a batch across an epoch's end may hold a sample twice)"]
    first, second = ([i for share, _ in step for i in share] for step in (drawn[0] + drawn[1], drawn[2] + drawn[3]))
    assert sorted(first + second[:2]) == list(range(10))  # stage 2 begins with the rest of the first epoch
