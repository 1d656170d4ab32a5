"""eval's ppl plot labels its log position axis at a few distinct powers of 2 that do not overlap
(issue 53 item 10.4; train/report.py token_log_axis)."""

import math

import pytest

from longctx.eval.plots import write_plot


def _ppl(lengths, buckets=16):
    return {"task": "ppl", "model": "m", "results": [
        {"length": n, "sequences": 1, "buckets": [
            {"start": -(-i * n // buckets), "end": -(-(i + 1) * n // buckets), "loss": 2 + 1 / math.log(2 + i)}
            for i in range(buckets)]} for n in lengths]}


@pytest.mark.parametrize("lengths", [[1024, 4096, 16384, 65536, 262144, 2**20], [4096], [65536, 131072]])
def test_the_ppl_plot_labels_few_distinct_ticks_that_do_not_overlap(tmp_path, monkeypatch, lengths):
    from matplotlib.figure import Figure

    saved, original = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append(self), original(self, *a, **k))[1])
    write_plot(_ppl(lengths), tmp_path / "ppl.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = saved[0]
    canvas = FigureCanvasAgg(fig)  # (pyplot's was detached when the figure was closed)
    canvas.draw()
    ax, renderer = fig.axes[0], canvas.get_renderer()
    x0, x1 = ax.get_xlim()
    shown = sorted((t for t in ax.xaxis.get_major_ticks() + ax.xaxis.get_minor_ticks()
                    if t.label1.get_visible() and t.label1.get_text() and x0 <= t.get_loc() <= x1),
                   key=lambda t: t.get_loc())
    labels = [t.label1.get_text() for t in shown]
    boxes = [t.label1.get_window_extent(renderer) for t in shown]
    assert 2 <= len(labels) <= 8 and len(set(labels)) == len(labels), labels
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), labels
    if lengths[-1] == 2**20:
        assert {"1K", "1M"} <= set(labels)
