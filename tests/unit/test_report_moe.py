"""longctx report / the run's plots: an MoE run also gets expert_load.png, a dense run does not."""

import json

from longctx.train.report import write_plots


def _record(step, moe):
    r = {"kind": "train", "step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1000.0, "mfu": 0.1,
         "memory_gib": 0.5, "memory_kind": "peak RSS"}
    if moe:
        r.update(moe_aux_loss=1.1, moe_z_loss=4.2, moe_load_mean=1.5 + step / 10, moe_load_worst=2.0,
                 moe_drop_rate=0.0, expert_rank_load=1.2)
    return r


def test_moe_runs_plot_expert_load(tmp_path):
    for moe in (False, True):
        run = tmp_path / ("moe" if moe else "dense")
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(_record(s, moe)) + "\n" for s in (1, 5, 10)))
        names = sorted(p.name for p in write_plots(run))
        expected = ["expert_load.png", "loss.png", "throughput.png"] if moe else ["loss.png", "throughput.png"]
        assert names == expected
        assert all((run / n).stat().st_size > 1000 for n in names)
