"""`longctx train` of a tiny MoE model with aux-loss-free routing: metrics.jsonl carries the interval
means of the router figures, per-layer loads, bias norms and per-expert loads, and the run's plots
include the expert heatmap.

The same run logged every step and every 3 steps trains the same bits (metrics never change the
training), so each 3-step record must equal the mean of the 3 per-step records it covers. The runs are in
this process (test_newcomer.longctx_here: the tests read what a run writes and says, not how its process
ends, and a new interpreter's imports cost seconds a run)."""

import json
import math
from pathlib import Path

import pytest
import torch
from test_newcomer import longctx_here

ROOT = Path(__file__).resolve().parents[2]
RATE = 0.01
RUN = ["--config", str(ROOT / "configs/debug.toml"), "--nproc", "1", "--model.preset=debug-moe",
       "--model.moe.router=sigmoid", "--model.moe.groups=2", "--model.moe.topk_groups=1", "--model.moe.aux_loss=0",
       f"--model.moe.bias_update_rate={RATE}", "--model.moe.z_loss=0.001", "--train.steps=6", "--train.seq_len=64",
       "--train.eval_interval=0", "--data.max_docs=80", "--metrics.progress=false"]
FIELDS = ("moe_aux_loss", "moe_z_loss", "moe_load_mean", "moe_load_worst", "moe_drop_rate")


def _train(run_dir: Path, log_interval: int) -> tuple[str, dict[int, dict]]:
    r = longctx_here("train", *RUN, f"--metrics.log_interval={log_interval}", f"--train.run_dir={run_dir}",
                     cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return r.stdout, {rec["step"]: rec for rec in records if rec.get("kind") == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe_metrics")
    return {n: (base / f"every{n}", *_train(base / f"every{n}", n)) for n in (1, 3)}


def test_records_are_interval_means(runs):
    _, _, each = runs[1]
    _, _, every3 = runs[3]
    assert sorted(every3) == [1, 3, 6]
    assert [r["loss"] for r in every3.values()] == [each[s]["loss"] for s in every3]  # the same training
    # the lines at steps 1, 3 and 6 (the first step has its own line): means over steps 2-3 and 4-6
    for step, steps in ((3, (2, 3)), (6, (4, 5, 6))):
        for key in FIELDS:
            mean = sum(each[s][key] for s in steps) / len(steps)
            assert every3[step][key] == pytest.approx(mean, rel=1e-6, abs=1e-9), key
            assert every3[step][key] != pytest.approx(each[step][key], rel=1e-6) or key == "moe_drop_rate", key
        layer_mean = [sum(each[s]["moe_layer_load"][i] for s in steps) / len(steps) for i in range(3)]
        assert every3[step]["moe_layer_load"] == pytest.approx(layer_mean, abs=2e-3)  # (rounded to 3 decimals)
        assert every3[step]["moe_bias_norm"] == each[step]["moe_bias_norm"]  # the bias as it stands at the line
    # the heatmap's columns: every 3 steps (steps 1-3, 4-6); a step's choices per layer are always
    # tokens x top_k, so a column's share is the mean of its steps' shares
    for step, steps in ((3, (1, 2, 3)), (6, (4, 5, 6))):
        shares = [[sum(each[s]["moe_expert_load"][i][e] for s in steps) / 3 for e in range(8)] for i in range(3)]
        for got, want in zip(every3[step]["moe_expert_load"], shares):
            assert got == pytest.approx(want, abs=1.0)  # (each rounded to an integer)
        assert every3[step]["moe_expert_load_from"] == steps[0]
    assert "moe_expert_load" not in every3[1]


def test_records_have_sane_per_layer_figures_and_the_heatmap_is_written(runs):
    run_dir, stdout, each = runs[1]
    assert "moe aux" in stdout and "load" in stdout  # the console line keeps its short form
    for step, r in each.items():
        assert r["moe_blocks"] == [1, 2, 3]  # debug-moe: block 0 dense
        assert all(1.0 <= v <= 4.0 for v in r["moe_layer_load"])  # 8 experts top-2: at most 4
        assert sum(r["moe_layer_load"]) / 3 == pytest.approx(r["moe_load_mean"], abs=2e-3)
        assert max(r["moe_layer_load"]) == pytest.approx(r["moe_load_worst"], abs=1e-3)
        assert all(abs(sum(row) - 800) <= 4 for row in r["moe_expert_load"])  # shares in % of an even share
        # each step moves every expert's bias by -rate, 0 or +rate
        assert all(0 < n <= RATE * step * math.sqrt(8) * 1.001 for n in r["moe_bias_norm"])  # (4 digits)
    assert (run_dir / "expert_heatmap.png").stat().st_size > 5000
    assert (runs[3][0] / "expert_heatmap.png").is_file()



def _records(tmp_path, name, *extra):
    run_dir = tmp_path / name
    args = [a for a in RUN if not a.startswith(("--model.moe.", "--train.eval_interval"))]
    r = longctx_here("train", *args, *extra, "--metrics.log_interval=3", f"--train.run_dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r.stdout, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_dts_eval_routes_as_training_at_that_step(tmp_path):
    """DTS-Gate's warm-up: the periodic eval routes as training at that step, and its line says so."""
    out, records = _records(tmp_path, "dts", "--model.moe.router=dts", "--model.moe.dts_steps=10",
                            "--model.moe.dts_temperature=2.0", "--train.eval_interval=3", "--train.eval_batches=1",
                            "--checkpoint.interval=6")
    evals = {rec["step"]: rec for rec in records if rec.get("kind") == "eval"}
    assert evals[3]["routing"].startswith("dts routing as training at step 3 (")
    said = "dts routing as training at step 6 ("
    assert "| " + said in out
    assert all("moe_layer_drop" not in rec for rec in records)  # dropless: no drop figure
    # its step-6 checkpoint, loaded as generate and eval --mode generate load it, routes as training did at step 6
    from longctx.config import load_config
    from longctx.generate.loading import load_model
    from longctx.models.moe_eval_routing import eval_routing_note

    cfg = load_config(None, {"model": {"init_from": str(tmp_path / "dts" / "checkpoints")}})
    note = eval_routing_note(load_model(cfg, torch.device("cpu"), torch.float32))
    assert note.startswith(said) and note == evals[6]["routing"]


def test_capacity_drops_per_layer(tmp_path):
    """With a capacity, metrics.jsonl has each MoE layer's drop rate over the interval."""
    _, records = _records(tmp_path, "capacity", "--model.moe.capacity_factor=1.0", "--train.eval_interval=0")
    train = [rec for rec in records if rec.get("kind") == "train"]
    drops = [rec["moe_layer_drop"] for rec in train]
    assert all(len(d) == len(train[0]["moe_blocks"]) and all(0 <= x < 1 for x in d) for d in drops)
    assert any(x > 0 for d in drops for x in d)  # a capacity of 1.0 drops some choices of an untrained router
    for rec, d in zip(train, drops):  # the layers' rates bracket the rate over all layers
        assert min(d) - 1e-4 <= rec["moe_drop_rate"] <= max(d) + 1e-4
