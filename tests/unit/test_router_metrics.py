"""train/router_metrics.py: the MoE figures of a metrics line are the interval's, computed by hand here
from known per-step counts, and summing them reads nothing from the device."""

import math
from types import SimpleNamespace

import pytest
import torch

from host_sync import no_host_sync
from longctx.models.moe_stats import layer_loads
from longctx.train.router_metrics import (
    EXPERT_LOAD_COLUMNS,
    ROUTER_FIELDS,
    RouterInterval,
    heatmap_every,
    rank_load,
)

# three steps of a 2-layer, 4-expert model: choices per expert [layers, E] (over every rank)
COUNTS = [
    [[4, 2, 1, 1], [2, 2, 2, 2]],
    [[1, 1, 1, 5], [3, 1, 2, 2]],
    [[6, 0, 1, 1], [1, 1, 1, 5]],
]


def _stats(counts, aux, z, drop):
    """A step's RouterTerms.stats [5], its load figures from the counts as models/moe.py forms them."""
    load = layer_loads(counts)
    return torch.stack([torch.tensor(aux), torch.tensor(z), load.mean(), load.max(), torch.tensor(drop)]).float()


def _add(interval, step, counts, applied=True, aux=1.0, z=2.0, drop=0.0):
    c = torch.tensor(counts, dtype=torch.float32)
    interval.add(step, _stats(c, aux, z, drop), layer_loads(c), c, torch.tensor(applied))


def test_the_record_holds_the_interval_means_not_the_last_step():
    interval = RouterInterval([1, 3], every=3)
    for step, (counts, aux) in enumerate(zip(COUNTS, (1.0, 1.5, 2.0)), start=1):
        _add(interval, step, counts, aux=aux, z=0.1 * step, drop=0.01 * step)
    r = interval.record(3)
    # per layer, max / mean of each step's counts (mean 2 choices per expert), averaged over the 3 steps
    layer0 = (4 / 2 + 5 / 2 + 6 / 2) / 3
    layer1 = (2 / 2 + 3 / 2 + 5 / 2) / 3
    assert r["moe_layer_load"] == [round(layer0, 3), round(layer1, 3)]
    assert r["moe_load_mean"] == pytest.approx((layer0 + layer1) / 2)
    assert r["moe_load_worst"] == pytest.approx((2.0 + 2.5 + 3.0) / 3)  # each step's worst layer, averaged
    assert r["moe_aux_loss"] == pytest.approx(1.5) and r["moe_z_loss"] == pytest.approx(0.2)
    assert r["moe_drop_rate"] == pytest.approx(0.02)
    assert r["moe_blocks"] == [1, 3] and "expert_rank_load" not in r and "moe_bias_norm" not in r
    # the heatmap column: each expert's share of the 24 choices of its layer, in % of an even share (6)
    assert r["moe_expert_load"] == [[round(100 * c / 6) for c in row] for row in ((11, 3, 3, 7), (6, 4, 5, 9))]
    assert r["moe_expert_load_from"] == 1
    # then a new interval: the next record is the next steps' alone
    _add(interval, 4, COUNTS[0], aux=7.0)
    r = interval.record(4)
    assert r["moe_aux_loss"] == pytest.approx(7.0) and r["moe_layer_load"] == [2.0, 1.0]


def test_heatmap_columns_span_several_lines_and_close_at_the_last_step():
    interval = RouterInterval([1, 2], every=4)
    records = {}
    for step in range(1, 8):
        _add(interval, step, COUNTS[step % 3])
        if step % 2 == 0 or step in (1, 7):  # the metrics lines (log interval 2, the first and the last)
            records[step] = interval.record(step, last=step == 7)
    assert [s for s, r in records.items() if "moe_expert_load" in r] == [4, 7]
    assert records[4]["moe_expert_load_from"] == 1 and records[7]["moe_expert_load_from"] == 5
    # steps 1-4: COUNTS[1], [2], [0], [1] -> layer 0 has 1+6+4+1 = 12 choices of expert 0 of 32
    assert records[4]["moe_expert_load"][0][0] == round(100 * 12 / 8)
    assert all("moe_layer_load" in r for r in records.values())  # per-layer loads on every line


def test_a_step_whose_update_was_not_applied_is_left_out():
    interval = RouterInterval([1, 2], every=1)
    _add(interval, 1, COUNTS[0], aux=1.0)
    _add(interval, 2, COUNTS[1], applied=False, aux=float("nan"))
    _add(interval, 3, COUNTS[2], aux=3.0)
    r = interval.record(3)
    assert r["moe_aux_loss"] == pytest.approx(2.0)
    assert r["moe_layer_load"][0] == round((4 / 2 + 6 / 2) / 2, 3)
    assert r["moe_expert_load"][0] == [round(100 * c / 4) for c in (10, 2, 2, 2)]  # steps 1 and 3 only
    # an interval of skipped steps alone: no router figures to average, no line fields
    _add(interval, 4, COUNTS[0], applied=False)
    assert not any(k in interval.record(4) for k in (*ROUTER_FIELDS, "moe_layer_load"))


def test_expert_rank_load_is_the_interval_mean_of_each_step_straggler():
    interval = RouterInterval([1, 2], expert=2, every=1)
    for step, counts in enumerate(COUNTS, start=1):
        _add(interval, step, counts)
    # expert ranks hold experts {0, 1} and {2, 3}; per step the worst layer's busiest rank over the mean
    per_step = [max(max(c[0] + c[1], c[2] + c[3]) / 4 for c in counts) for counts in COUNTS]
    assert per_step == [1.5, 1.5, 1.5]
    assert interval.record(3)["expert_rank_load"] == pytest.approx(sum(per_step) / 3)
    assert rank_load(torch.tensor(COUNTS[1], dtype=torch.float32), 2) == pytest.approx(1.5)


def test_bias_norms_are_read_at_the_line():
    biases = [torch.tensor([0.03, -0.04, 0.0, 0.0]), torch.tensor([0.01, 0.01, -0.01, -0.01])]
    layers = [SimpleNamespace(router=SimpleNamespace(expert_bias=b)) for b in biases]
    interval = RouterInterval([1, 2], every=10, bias_layers=layers)
    _add(interval, 1, COUNTS[0])
    assert interval.record(1)["moe_bias_norm"] == [0.05, 0.02]
    biases[0][0] = 0.3  # the buffer as it stands at the next line
    _add(interval, 2, COUNTS[1])
    assert interval.record(2)["moe_bias_norm"][0] == pytest.approx(math.hypot(0.3, 0.04), rel=1e-3)


def test_summing_a_step_reads_nothing_from_the_device():
    interval = RouterInterval([1, 2], expert=2, every=1)
    with no_host_sync():
        for step, counts in enumerate(COUNTS, start=1):
            _add(interval, step, counts, applied=step != 2)
    assert interval.record(3)["moe_layer_load"]


@pytest.mark.parametrize("log_interval, steps", [(5, 30), (10, 1000), (10, 1001), (1, 100_000), (7, 50_000)])
def test_a_run_has_at_most_a_bounded_number_of_heatmap_columns(log_interval, steps):
    every = heatmap_every(log_interval, steps)
    assert every % log_interval == 0
    assert steps // every + 1 <= EXPERT_LOAD_COLUMNS + 1  # (+1: the last step closes a column)
    if steps <= log_interval * EXPERT_LOAD_COLUMNS:
        assert every == log_interval  # short runs: a column on every line


def test_per_layer_drop_rate_is_the_intervals_dropped_over_its_choices():
    interval = RouterInterval([1, 3])
    drops = [[2.0, 0.0], [6.0, 1.0], [0.0, 3.0]]  # per step, per layer (each layer has 8 choices a step)
    for step, (counts, d) in enumerate(zip(COUNTS, drops), start=1):
        c = torch.tensor(counts, dtype=torch.float32)
        interval.add(step, _stats(c, 1.0, 1.0, 0.0), layer_loads(c), c, torch.tensor(step != 2), torch.tensor(d))
    r = interval.record(3)  # step 2's update was not applied: left out
    assert r["moe_layer_drop"] == [round(2 / 16, 4), round(3 / 16, 4)]
    _add(interval, 4, COUNTS[0])  # no capacity: no per-layer drop figure
    assert "moe_layer_drop" not in interval.record(4)


def test_reset_forgets_the_steps_a_rollback_discarded():
    interval = RouterInterval([1, 3], every=3)
    _add(interval, 1, COUNTS[0], aux=9.0)
    _add(interval, 2, COUNTS[1], aux=9.0)
    interval.reset()  # (read_back.py roll_back_trainer: those steps run again)
    _add(interval, 2, COUNTS[2], aux=1.0)
    _add(interval, 3, COUNTS[0], aux=2.0)
    r = interval.record(3)
    assert r["moe_aux_loss"] == pytest.approx(1.5) and r["moe_expert_load_from"] == 2


def test_expert_rank_load_counts_flexmoe_copies():
    """Under FlexMoE's copies a rank runs its holders' share of each expert's rows: the figure follows
    the placement (it showed the static placement's straggler, as if the copies took nothing)."""
    from longctx.parallel.expert.placement import Placement, plan_placement

    counts = torch.tensor([[6.0, 2.0, 2.0, 2.0]])  # one layer, 4 experts on 2 ranks: static loads 8 and 4
    assert rank_load(counts, 2) == pytest.approx(8 / 6)
    # half of expert 0's rows on rank 1 (slot 2, its copy slot): ranks run 3 + 2 and 3 + 2 + 2
    half = Placement(2, 2, 1, ((0, 1, -1), (2, 3, 0)), (((0, 0, 0.5), (1, 2, 0.5)), ((0, 1, 1.0),),
                                                        ((1, 0, 1.0),), ((1, 1, 1.0),)))
    assert half.rank_shares() == [[0.5, 0.5], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]
    shares = torch.tensor([half.rank_shares()], dtype=torch.float64)
    assert rank_load(counts, 2, shares) == pytest.approx(7 / 6)
    assert rank_load(counts, 2, torch.tensor([Placement.static(4, 2).rank_shares()])) == pytest.approx(8 / 6)
    # the policy's own prediction of the load after its placement (its water-filling, computed apart)
    planned = plan_placement([6, 2, 2, 2], 2, 1)
    got = rank_load(counts, 2, torch.tensor([planned.rank_shares()], dtype=torch.float64))
    assert got == pytest.approx(planned.predicted["max_over_mean_after"])
    assert got < planned.predicted["max_over_mean_before"]
    interval = RouterInterval([1], expert=2, every=1)
    interval.add(1, _stats(counts, 1.0, 2.0, 0.0), layer_loads(counts), counts, torch.tensor(True), shares=shares)
    assert interval.record(1)["expert_rank_load"] == pytest.approx(7 / 6)
