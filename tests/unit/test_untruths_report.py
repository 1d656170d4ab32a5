"""The run's plots and messages say what they show (issue 53 item 10): the loss plot names its
train points (one logged step's loss each, or an interval's mean), the heatmap of one MoE layer
says "1 MoE layer", and a log token axis labels a few distinct powers of 2 that do not overlap."""

import json
import math
from types import SimpleNamespace

import pytest

from longctx.train.report import SMOOTHING_POINTS, token_log_axis, write_plots


@pytest.fixture
def figures(monkeypatch):
    """Every figure write_plots saves, by file name (kept open enough to read texts and lines)."""
    from matplotlib.figure import Figure

    saved, original = {}, Figure.savefig

    def savefig(self, path, *a, **k):
        saved[str(path).rsplit("/", 1)[-1]] = self
        return original(self, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _write(run, records):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _record(step, loss, **extra):
    return {"kind": "train", "step": step, "loss": loss, "tokens_per_s": 1000.0, "mfu": 0.1, "memory_gib": 0.5,
            "memory_kind": "peak RSS", **extra}


STEPS = [1, *range(10, 101, 10)]


def test_the_loss_plot_says_its_points_are_single_logged_steps(tmp_path, figures):
    losses = [5 - math.log(s) / 2 + (0.3 if s % 20 else -0.3) for s in STEPS]  # noisy, as single steps are
    _write(tmp_path / "run", [_record(s, lo) for s, lo in zip(STEPS, losses)] + [
        {"kind": "eval", "step": 50, "loss": 3.0}])
    write_plots(tmp_path / "run")
    ax = figures["loss.png"].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"train (the logged step's loss, every 10 steps)", "eval (the mean over its labelled tokens)",
                          f"train (moving mean of {SMOOTHING_POINTS} logged steps, centred)"}
    raw = lines["train (the logged step's loss, every 10 steps)"]
    assert list(raw.get_xdata()) == STEPS and list(raw.get_ydata()) == losses
    mean = lines[f"train (moving mean of {SMOOTHING_POINTS} logged steps, centred)"]
    n, half = SMOOTHING_POINTS, SMOOTHING_POINTS // 2
    assert list(mean.get_xdata()) == STEPS[half:len(STEPS) - half]  # whole windows only
    assert mean.get_ydata() == pytest.approx([sum(losses[i:i + n]) / n for i in range(len(STEPS) - n + 1)])


def test_records_with_the_interval_mean_plot_that_mean(tmp_path, figures):
    _write(tmp_path / "run", [_record(s, 9.0, loss_mean=4 - s / 100) for s in STEPS])
    write_plots(tmp_path / "run")
    (line,) = figures["loss.png"].axes[0].get_lines()
    assert line.get_label() == "train (mean over each log interval)"
    assert list(line.get_ydata()) == [4 - s / 100 for s in STEPS]


@pytest.mark.parametrize("layers", [1, 3])
def test_the_heatmap_counts_its_moe_layers_in_words(tmp_path, figures, layers):
    load = [[100] * 4 for _ in range(layers)]
    _write(tmp_path / "run", [_record(s, 3.0, moe_aux_loss=1.0, moe_z_loss=1.0, moe_load_mean=1.0, moe_load_worst=1.0,
                                      moe_drop_rate=0.0, moe_expert_load=load) for s in (5, 10)])
    write_plots(tmp_path / "run")
    title = figures["expert_heatmap.png"]._suptitle.get_text().splitlines()
    assert title[1] == ("1 MoE layer" if layers == 1 else f"{layers} MoE layers")


def _labels(lo, hi, axis=token_log_axis):
    """The labelled ticks of a token axis drawn over positions lo..hi (ppl buckets' midpoints), and
    whether any two labels overlap on the rendered figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    ax.plot(xs, [1 / math.log(x + 2) for x in xs], marker=".")
    axis(ax)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    x0, x1 = ax.get_xlim()
    shown = [t for t in ax.xaxis.get_major_ticks() + ax.xaxis.get_minor_ticks()
             if t.label1.get_visible() and t.label1.get_text() and x0 <= t.get_loc() <= x1]
    boxes = sorted((t.label1.get_window_extent(renderer) for t in shown), key=lambda b: b.x0)
    overlap = any(a.x1 > b.x0 for a, b in zip(boxes, boxes[1:]))
    plt.close(fig)
    return [t.label1.get_text() for t in sorted(shown, key=lambda t: t.get_loc())], overlap


def test_a_token_axis_from_1k_to_1m_labels_few_distinct_powers_of_2():
    labels, overlap = _labels(32, 2**20)  # the ppl plot of lengths 1K..1M: positions from the first bucket's
    assert labels == ["64", "256", "1K", "4K", "16K", "64K", "256K", "1M"] and not overlap
    # the check can fail: matplotlib's own log axis over one 4K length's positions labels its minor
    # ticks (2x10^2 ... 4x10^3), and they run into one another
    labels, overlap = _labels(128, 3968, axis=lambda ax: ax.set_xscale("log"))
    assert overlap


@pytest.mark.parametrize("lo, hi", [(128, 3968), (2048, 2**17), (32, 2**24), (1, 60)])
def test_a_token_axis_never_crowds_its_labels(lo, hi):
    labels, overlap = _labels(lo, hi)
    assert 2 <= len(labels) <= 8 and len(set(labels)) == len(labels) and not overlap, labels


def test_bench_decode_counts_layers_in_words(monkeypatch, capsys):
    """The models line of `longctx bench decode`, a one-layer draft (up to the line; nothing runs)."""
    import longctx.generate.drafts as drafts
    import longctx.generate.engine as engine
    import longctx.generate.loading as gen_cli
    from longctx.bench import decode

    class Said(Exception):
        pass

    cfg = SimpleNamespace(model=SimpleNamespace(label="debug", layers=4, moe_capacity_factor=0.0))
    monkeypatch.setattr(decode, "_models", lambda args: (cfg, None, None, "byte"))
    monkeypatch.setattr(decode, "_prompts", lambda *a: {8: [list(range(8))]})
    monkeypatch.setattr(gen_cli, "load_model", lambda *a: None)
    monkeypatch.setattr(drafts, "load_draft", lambda *a: SimpleNamespace(layers=[None]))
    monkeypatch.setattr(drafts, "draft_label", lambda c: "glide")
    monkeypatch.setattr(engine, "generate", lambda *a, **k: (_ for _ in ()).throw(Said()))
    args = SimpleNamespace(threads=0, device="cpu", dtype="fp32", cape="false", cape_table="", temperature=0.0,
                           seed=0, speculate=4, speculate_adaptive="false", draft_cost=0.0, repeats=1, max_new_tokens=4)
    with pytest.raises(Said):
        decode.main(args)
    assert "target debug (4 layers), draft glide (1 layer), K = 4" in capsys.readouterr().err
