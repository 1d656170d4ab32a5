"""The training phase's count moves inside a step (train/step_progress.py). A heartbeat line said
"training [3m10s]: 0/1 steps" through the whole of one long step, so a slow step read as a hung one and the time
left was unknown until the first step ended. Now each block's forward and backward, per micro-batch, moves the
count by its part of the step: the count only goes up, stays below the step's whole until the step ends, and is
then exactly whole. A recomputation is not counted as a second forward; a compiled run compiles the same graphs.

Every value the count takes is read by a recording Phase (what any heartbeat line could have read), no sleeps."""

import functools
import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import longctx.progress as progress_module
from longctx.progress import phase
from phase_spy import RecordedPhase, record_speaking, train_quietly, training_values

BASE = ["--model.layers=2", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=20",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--checkpoint.final=false",
        "--train.eval_interval=0", "--metrics.log_interval=1"]


@pytest.fixture
def recorded(monkeypatch):
    """The phases made while the test runs, each recording its count (rank 0, lines on but not due in a test)."""
    return record_speaking(monkeypatch)


def _train(tmp_path, *extra, before_run=None):
    return train_quietly([*BASE, f"--train.run_dir={tmp_path / 'run'}", *extra], before_run)


_training = training_values


def _check_steps(values: list[float], steps: int) -> list[float]:
    """The count's values never go back, never reach a step's whole before its end, and end whole: the values
    strictly inside a step are returned."""
    assert values == sorted(values), values
    assert values[-1] == steps and values[0] == 0, values
    inside = [v for v in values if v != int(v)]
    for k in range(steps):  # (a step's end sets it to k + 1 exactly; what came before stayed below)
        assert k + 1 in values, values
    return inside


def test_the_count_moves_through_a_step_block_by_block_and_ends_whole(tmp_path, recorded):
    _train(tmp_path, "--train.steps=1")
    inside = _check_steps(_training(recorded), 1)
    # two blocks, each counted when its forward returns and when its backward starts: several values in (0, 1)
    assert len(set(inside)) >= 4, inside
    assert all(0 < v < 1 for v in inside), inside
    # a block's backward is about twice its forward: past half the step, the count is in the backward
    assert max(inside) > 0.5, inside


def test_under_full_recompute_the_count_never_passes_the_step_nor_goes_back(tmp_path, recorded):
    _train(tmp_path, "--train.steps=2", "--memory.recompute=full")
    inside = _check_steps(_training(recorded), 2)
    assert len({v for v in inside if v < 1}) >= 4 and len({v for v in inside if v > 1}) >= 4, inside


def test_a_moe_model_counts_its_blocks_too(tmp_path, recorded):
    _train(tmp_path, "--model.preset=debug-moe", "--model.layers=2", "--train.steps=1",
           "--memory.recompute=selective")
    inside = _check_steps(_training(recorded), 1)
    assert len(set(inside)) >= 4, inside


def test_grad_accum_2_counts_each_micro_batch_a_half(tmp_path, recorded):
    starts: list[float] = []

    def mark_micro_batch_starts(trainer):
        def first_block_starts(*_):  # (the first block's forward in the step, not a recomputation in backward)
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                starts.append(progress_module.current().done)
        trainer.model.layers[0].register_forward_pre_hook(first_block_starts)

    _train(tmp_path, "--train.steps=1", "--train.grad_accum=2", before_run=mark_micro_batch_starts)
    values = _training(recorded)
    inside = _check_steps(values, 1)
    first, second = starts
    assert first == 0
    # each micro-batch is half the step's work before the optimizer's small rest
    assert 0.45 <= second <= 0.5, starts
    in_first = [v for v in inside if v < second]
    assert in_first and max(in_first) > 0.25, (starts, inside)  # (its backward counted before the second starts)
    assert max(inside) > second + 0.25, (starts, inside)  # (and the second's)


def test_a_recomputed_forward_is_not_counted_again():
    """Blocks called inside a checkpoint that runs them whole again in backward (their forward hooks fire again
    there): the same count, value for value, as the same blocks without recomputation."""
    from longctx.train.step_progress import StepCounts

    def counts(recompute: bool) -> list[float]:
        torch.manual_seed(0)
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))
        p = RecordedPhase("training", total=1, unit="steps")
        counter = StepCounts(p, blocks)
        x = torch.randn(2, 4, requires_grad=True)
        counter.micro_batch(0, 1)
        with set_checkpoint_early_stop(False):  # (early, the recomputation would stop before the block's end)
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
            torch.tanh(x).sum().backward()
        counter.end(1)
        counter.close()
        return p.values

    plain, recomputed = counts(False), counts(True)
    assert recomputed == plain, (recomputed, plain)
    assert plain == sorted(plain) and len(set(plain)) >= 6 and plain[-1] == 1, plain  # (3 forwards, 3 gradients)


def test_a_quiet_phase_gets_no_hooks(monkeypatch):
    """Where no line reads the count (lines off, or a rank > 0), the blocks are left as they are."""
    from longctx.train.step_progress import StepCounts

    monkeypatch.setenv("LONGCTX_PROGRESS_S", "0")
    blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    with phase("training", total=3, unit="steps") as quiet:
        counter = StepCounts(quiet, blocks)
        assert not counter.handles and not any(b._forward_hooks for b in blocks)
        counter.micro_batch(0, 1)
        counter.end(1)
        assert quiet.done == 1


def test_a_compiled_run_compiles_the_same_graphs_with_the_counting_hooks(tmp_path, recorded, monkeypatch):
    from torch._dynamo.testing import CompileCounter

    def run(name: str, lines_s: str):
        torch._dynamo.reset()
        monkeypatch.setenv("LONGCTX_PROGRESS_S", lines_s)
        counter = CompileCounter()
        monkeypatch.setattr(torch, "compile", functools.partial(real_compile, backend=counter))
        trainer = _train(tmp_path / name, "--train.steps=3", "--train.compile=true")
        records = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        return counter.frame_count, counter.op_count, [r["compile_recompiles"] for r in records if r["kind"] == "train"]

    real_compile = torch.compile
    try:
        hooked = run("hooked", "1000")
        assert len(set(_training(recorded))) > 4  # (the hooks counted)
        quiet = run("quiet", "0")  # (no phase speaks: no hooks)
    finally:
        torch._dynamo.reset()
    assert hooked == quiet, (hooked, quiet)
    assert hooked[2] == [0, 0, 0], hooked


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_every_blocks_backward_is_counted_before_the_update(tmp_path, recorded, recompute):
    """The first block's backward ends with its input's gradient, after every block output's: counted by no hook, a
    plain step's count stood near 0.8 from the last output gradient to the update. Now it reaches the micro-batches'
    whole, 1 - the update's part (0.02 with the states on the device), before the update makes it 1."""
    from longctx.train.step_progress import REST

    _train(tmp_path, "--train.steps=1", f"--memory.recompute={recompute}")
    inside = _check_steps(_training(recorded), 1)
    assert max(inside) == pytest.approx(1 - REST, abs=1e-9), inside
