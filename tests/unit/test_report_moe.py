"""longctx report / the run's plots: an MoE run also gets expert_load.png, and expert_heatmap.png when
its records carry per-expert loads; a dense run gets neither."""

import json

import numpy as np
import pytest

from longctx.train.report import HEATMAP_PANELS, write_plots


def _record(step, moe, experts=None):
    r = {"kind": "train", "step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1000.0, "mfu": 0.1,
         "memory_gib": 0.5, "memory_kind": "peak RSS"}
    if moe:
        r.update(moe_aux_loss=1.1, moe_z_loss=4.2, moe_load_mean=1.5 + step / 10, moe_load_worst=2.0,
                 moe_drop_rate=0.0, expert_rank_load=1.2)
    if experts is not None:
        r.update(moe_expert_load=experts, moe_blocks=list(range(1, len(experts) + 1)))
    return r


def _write(run, records):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_moe_runs_plot_expert_load(tmp_path):
    for moe in (False, True):
        run = tmp_path / ("moe" if moe else "dense")
        _write(run, [_record(s, moe) for s in (1, 5, 10)])
        names = sorted(p.name for p in write_plots(run))
        expected = ["expert_load.png", "loss.png", "throughput.png"] if moe else ["loss.png", "throughput.png"]
        assert names == expected
        assert all((run / n).stat().st_size > 1000 for n in names)


@pytest.mark.parametrize("layers, experts", [(3, 8), (HEATMAP_PANELS + 4, 64)])
def test_per_expert_loads_give_a_heatmap(tmp_path, layers, experts):
    """Columns of several widths, a gap (a resumed run's missing records), an idle expert, and more
    layers than panels."""
    rng = np.random.default_rng(0)
    records, spans = [], [(1, 5), (6, 10), (21, 30)]
    for first, last in spans:
        load = np.round(100 * rng.dirichlet(np.ones(experts), size=layers) * experts).astype(int)
        load[0, 0] = 0
        records.append({**_record(last, True, load.tolist()), "moe_expert_load_from": first})
    records.insert(1, _record(8, True))  # a line without a column (the spacing of columns is coarser)
    run = tmp_path / "run"
    _write(run, records)
    written = {p.name for p in write_plots(run)}
    assert {"expert_load.png", "expert_heatmap.png"} <= written
    assert (run / "expert_heatmap.png").stat().st_size > 5000


def _plotted_labels(tmp_path, monkeypatch, records) -> list[str]:
    """The labels of every line expert_load.png draws (the figure read as it is closed)."""
    import matplotlib.pyplot as plt

    seen: list[str] = []
    close = plt.close

    def read_then_close(fig=None):
        if fig is not None and hasattr(fig, "axes"):
            seen.extend(line.get_label() for ax in fig.axes for line in ax.get_lines())
        close(fig)

    monkeypatch.setattr(plt, "close", read_then_close)
    run = tmp_path / "run"
    _write(run, records)
    write_plots(run)
    return seen


def test_a_capacity_run_plots_its_drop_rate(tmp_path, monkeypatch):
    """moe_drop_rate was in metrics.jsonl and the console line only: the plot beside the load (choices before
    drops) did not say how many of them never ran."""
    records = [{**_record(s, True), "moe_drop_rate": 0.1 * s, "moe_layer_drop": [0.1 * s]} for s in (1, 2, 3)]
    assert any("dropped" in label for label in _plotted_labels(tmp_path, monkeypatch, records))


def test_a_dropless_run_plots_no_drop_rate(tmp_path, monkeypatch):
    labels = _plotted_labels(tmp_path, monkeypatch, [_record(s, True) for s in (1, 2, 3)])
    assert labels and not any("dropped" in label for label in labels)
