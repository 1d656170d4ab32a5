"""FlexMoE's placements survive a checkpoint (parallel/expert/placement.py ExpertPlacer.state_dict,
train/step_state.py): a run resumed in the middle of a placement window places its expert copies
where the uninterrupted run does, from the same router counts, at the same steps.

Before they were saved, a resume started on the static placement with an empty window: the first
re-placement came a whole window after the resume (and one step later still: the last step's counts,
which the next step's placer reads, were lost too), planned from other steps' counts.
"""

from types import SimpleNamespace

import pytest
import torch
from test_training_parity import BASE

from longctx.parallel.expert.placement import ExpertPlacer, plan_placement

LAYERS, E, EP = 2, 8, 2


def _placer(window=3):
    layers = [SimpleNamespace(experts=SimpleNamespace(w1=torch.zeros(E, 4, 6), placement=None))
              for _ in range(LAYERS)]
    return ExpertPlacer(layers, EP, replicas=1, window=window)


def _placements(placer):
    return [layer.experts.placement for layer in placer.layers]


def _counts(step):
    """Skewed, changing router counts [layers, E]: expert (step + layer) % E is hot."""
    g = torch.Generator().manual_seed(step)
    c = torch.randint(1, 20, (LAYERS, E), generator=g).float()
    for layer in range(LAYERS):
        c[layer, (step + layer) % E] += 200
    return c


def test_a_placer_loaded_from_a_state_places_as_the_one_that_saved_it():
    first = _placer()
    for step in range(1, 6):  # a window ended at 3; steps 4-5 are in the next one
        first.observe(_counts(step))
    state = first.state_dict()
    assert state["steps"] == 5 and state["seen"] is not None
    # the placements in use are the policy's, planned from the summed counts of steps 1-3 (independently)
    window = sum(_counts(s) for s in (1, 2, 3))
    assert _placements(first) == [plan_placement(row, EP, 1) for row in window.tolist()]
    second = _placer()
    second.load_state_dict(state)
    assert _placements(second) == _placements(first) and all(p is not None for p in _placements(second))
    for step in (6, 7, 8, 9):  # the window ends at 6 and at 9 for both
        said = first.observe(_counts(step)), second.observe(_counts(step))
        assert (said[0] is None) == (said[1] is None) and _placements(second) == _placements(first), step
    assert _placements(first) != [plan_placement(row, EP, 1) for row in window.tolist()]  # (re-placed since)


def test_an_empty_state_is_the_static_start():
    placer = _placer()
    placer.load_state_dict(None)
    assert placer.steps == 0 and placer.seen is None and _placements(placer) == [None] * LAYERS


# ----------------------------------------------------------------------------------------------
# training: debug-moe under expert 2 with one copy slot, re-placed every 3 steps, saved at step 4

RUN = [*BASE, "--model.preset=debug-moe", "--train.steps=8", "--checkpoint.interval=4", "--parallel.expert=2",
       "--parallel.expert_replicas=1", "--parallel.expert_placement_window=3", "--metrics.log_interval=1"]


def _train(run_dir, resume=None):
    """(losses, placement log lines, the placements in use at the end, trainer_state.json's "moe" at step 4)."""
    import json
    from pathlib import Path

    from longctx.config import load_config
    from longctx.models.moe import moe_layers
    from longctx.train.trainer import Trainer

    extra = [] if resume is None else [f"--checkpoint.resume={resume}"]
    lines = []
    trainer = Trainer(load_config("configs/debug.toml", [*RUN, *extra, f"--train.run_dir={run_dir}"]),
                      log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    losses = trainer.run().losses
    saved = Path(resume or Path(run_dir) / "checkpoints" / "step-00000004") / "trainer_state.json"
    return (losses, [x for x in lines if "expert placement" in x],
            [m.experts.placement for m in moe_layers(trainer.model)], json.loads(saved.read_text()).get("moe"))


@pytest.mark.slow
def test_a_resumed_run_places_its_copies_as_the_uninterrupted_run(tmp_path):
    from longctx.job.spawn import run_spawned_many

    saved = tmp_path / "whole" / "checkpoints" / "step-00000004"
    out = run_spawned_many(2, [("whole", _train, (str(tmp_path / "whole"),)),
                               ("resumed", _train, (str(tmp_path / "resumed"), str(saved)))])
    (losses, lines, placed, moe), (r_losses, r_lines, r_placed, _) = out["whole"][0], out["resumed"][0]
    assert len(lines) == 2, lines  # placed before steps 4 and 7 (from steps 1-3 and 4-6)
    assert all(p is not None and p.copies > 0 for p in placed)  # copies in use: the comparison says something
    assert r_lines == lines[1:]  # the resumed run re-places before step 7, from the same counts
    assert r_placed == placed
    assert moe["placer"]["steps"] == 3 and len(moe["router_counts"]) == len(placed)  # step 4's counts, unplaced
    diff = max(abs(a - b) for a, b in zip(r_losses, losses[4:], strict=True))
    print(f"resumed vs uninterrupted, steps 5-8: max |loss diff| {diff:.2e}")
    assert diff <= 1e-6
