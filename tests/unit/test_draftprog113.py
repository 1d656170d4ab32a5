"""The training phase's count within a step (train/step_progress.py), three gaps (draftprog113):

(a) a draft's training (draft.target: GliDe, Clover) counted only the draft's blocks, so the frozen target's
    forward, most of a draft step, left the count flat and then it jumped through the draft's blocks; the target's
    blocks now move it, by the target's FLOP part of the micro-batch (models/flops.py), and the step ends whole;
(b) the optimizer step's part was a fixed 0.02; under memory.model_states = host (the AdamW step on the host's
    cores, exposed) it is the tier's predicted part, counted once the update is done;
(c) a rollback's checkpoint read ran with no phase; it is "checkpoint: reading PATH", counting its MB, as a
    resume's is.

Every value a count takes is read by a recording Phase (tests/phase_spy.py): no sleeps, no timings."""

import pytest
import torch

import longctx.progress as progress_module
from longctx.config import load_config
from longctx.models.flops import draft_train_flops_per_token, forward_flops_per_token
from longctx.train.trainer import Trainer
from phase_spy import record_speaking, train_quietly, training_values

QUIET = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=20",
         "--train.device=cpu", "--metrics.log_interval=1"]


@pytest.fixture
def recorded(monkeypatch):
    """The phases made while the test runs, each recording its count (rank 0, lines on but not due in a test)."""
    return record_speaking(monkeypatch)


def _train(tmp_path, *extra, before_run=None):
    return train_quietly([*QUIET, f"--train.run_dir={tmp_path}", *extra], before_run)


_training = training_values


def _never_back_and_whole(values: list[float], steps: int) -> None:
    assert values == sorted(values) and values[0] == 0 and values[-1] == steps, values
    assert all(k + 1 in values for k in range(steps)), values


# -- (a) a draft's training counts the frozen target's forward ------------------------------------------------


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer target, one step trained, saved by the normal path: its checkpoints directory."""
    run = tmp_path_factory.mktemp("target")
    cfg = load_config(None, [*QUIET, "--model.layers=4", "--train.seq_len=32", "--train.global_batch=1",
                             "--train.steps=1", f"--train.run_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).run()
    return run / "checkpoints"


@pytest.mark.parametrize("kind", ["glide", "clover"])
def test_a_draft_steps_count_moves_through_the_targets_forward_and_ends_whole(tmp_path, recorded, target, kind):
    seen = {"target": [], "draft": []}

    def mark(trainer):
        def at(name):
            def hook(*_):
                if torch._C._current_graph_task_id() == -1:  # (not a recomputation in the backward)
                    seen[name].append(progress_module.current().done)
            return hook
        trainer.model.target.layers[0].register_forward_pre_hook(at("target"))  # (the target's forward starts)
        trainer.model.layers[0].register_forward_pre_hook(at("draft"))  # (the target's forward is over)

    extra = ["--draft.layers=1"] if kind == "glide" else []
    trainer = _train(tmp_path, f"--draft.target={target}", f"--draft.kind={kind}", "--train.seq_len=32",
           "--train.global_batch=1", "--train.steps=1", *extra, before_run=mark)
    values = _training(recorded)
    _never_back_and_whole(values, 1)
    (start,), (draft_start,) = seen["target"], seen["draft"][:1]
    during = [v for v in values if start < v <= draft_start]
    # the target's 4 blocks each moved the count as they returned (before: flat until the draft's block)
    assert len(set(during)) >= 4, (start, draft_start, values)
    # a 4-layer target's forward is a good part of a step that trains one draft block, yet not all of it
    assert 0.2 < draft_start - start < 0.9, (start, draft_start, values)
    # by the FLOP terms of the draft step's count (models/flops.py): the target's forward without its LM head over
    # the whole, of the step's micro-batches' part (its optimizer step's 0.02 aside, the states on the device)
    cfg, d = trainer.cfg, trainer.cfg.draft
    m = cfg.model
    whole = draft_train_flops_per_token(m, 32, kind=kind, layers=d.layers, block=d.block, vocab=d.vocab,
                                        kd=d.loss == "kd")
    target_forward = forward_flops_per_token(m, 32) - 2 * m.dim * m.vocab_size
    assert draft_start - start == pytest.approx(0.98 * target_forward / whole), (start, draft_start)


def _second_micro_batch_start(tmp_path, *extra) -> tuple[float, list[float], list[float]]:
    """A 2-step run of 2 micro-batches a step: where the count stood as the second micro-batch of step 1 started
    (its first's share: (1 - the step's rest) / 2), and as each update started and once each was done."""
    starts, before, after = [], [], []

    def mark(trainer):
        def first_block_starts(*_):  # (the first block's forward, not a recomputation in the backward)
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                starts.append(progress_module.current().done)
        trainer.model.layers[0].register_forward_pre_hook(first_block_starts)
        real_step, real_zero = trainer.optimizer.step, trainer.optimizer.zero_grad
        trainer.optimizer.step = lambda *a, **k: (before.append(progress_module.current().done), real_step(*a, **k))[1]
        trainer.optimizer.zero_grad = lambda *a, **k: (after.append(progress_module.current().done),
                                                       real_zero(*a, **k))[1]

    # a 0.5M-parameter model over 16 tokens a micro-batch, at a peak 100x this CPU's (10 TFLOP/s): a host AdamW
    # of its parameters is a good part of such a step
    _train(tmp_path, "--model.layers=2", "--train.seq_len=16", "--train.global_batch=2", "--train.grad_accum=2",
           "--train.steps=2", "--metrics.peak_tflops=10", *extra, before_run=mark)
    return starts[1], before, after[-2:]


def test_with_the_states_on_the_device_the_rest_is_as_it_was(tmp_path, recorded):
    second, before, after = _second_micro_batch_start(tmp_path)
    _never_back_and_whole(_training(recorded), 2)
    assert second == pytest.approx((1 - 0.02) / 2), second  # (a dense run's weights unchanged)
    assert before[0] <= 0.98 + 1e-9 and after == [1, 2], (before, after)  # (the update: its 0.02 once done)


# -- (b) a host tier's update is a counted part of the step ----------------------------------------------------


def test_under_host_model_states_the_update_is_its_part_of_the_step_counted_when_done(tmp_path, recorded):
    second, before, after = _second_micro_batch_start(tmp_path, "--memory.model_states=host")
    values = _training(recorded)
    _never_back_and_whole(values, 2)
    # the update's part is the host AdamW's: the micro-batches' shares are far less than (1 - 0.02) / 2 each
    assert second < 0.4, second
    # the count stays below the step's whole until its update is done, and is whole as it is done
    assert before[0] <= 2 * second and 1 < before[1] <= 1 + 2 * second, (second, before)
    assert after == [1, 2], after
    assert not [v for v in values if before[0] < v < 1], values


# -- (c) a rollback's read is a phase that counts its MB ------------------------------------------------------


def test_a_rollbacks_checkpoint_read_counts_its_mb(tmp_path, recorded, monkeypatch):
    monkeypatch.setenv("LONGCTX_FAULT", "nonfinite@2")  # (step 2 bad: read at once, back to step 1's checkpoint)
    _train(tmp_path, "--model.layers=2", "--train.seq_len=16", "--train.global_batch=1", "--train.steps=3",
           "--checkpoint.interval=1", "--train.on_nonfinite=rollback")
    reads = [p for p in recorded if p.what.startswith("checkpoint: reading ")]
    assert len(reads) == 1 and reads[0].what.endswith("step-00000001"), [p.what for p in recorded]
    read = reads[0]
    assert read.unit == "MB" and read.total and read.total > 0, (read.total, read.unit)
    assert read.values and read.values == sorted(read.values) and read.values[-1] == read.total, read.values
    assert len(set(read.values)) >= 2, read.values  # (counted as the read went, not only at its end)
    _never_back_and_whole(_training(recorded), 3)
