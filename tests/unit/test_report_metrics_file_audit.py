"""`longctx report RUN` for a run trained with --metrics.file elsewhere: it looked for RUN/metrics.jsonl only and
refused the run directory ("does not exist; pass the run directory a `longctx train` run wrote"). It now reads
where the run's config.toml says its metrics went."""

from longctx.cli import main
from longctx.config import load_config
from longctx.train.trainer import Trainer


def test_report_finds_the_metrics_file_the_run_was_given(tmp_path, capsys):
    metrics = tmp_path / "elsewhere" / "m.jsonl"
    run = tmp_path / "run"
    Trainer(load_config(None, ["--train.steps=2", "--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40",
                               "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
                               "--train.device=cpu", "--model.layers=1", "--checkpoint.final=false",
                               f"--metrics.file={metrics}", f"--train.run_dir={run}"]), log=lambda *a, **k: None).run()
    assert metrics.is_file() and not (run / "metrics.jsonl").exists()
    assert main(["report", str(run)]) == 0
    assert (run / "loss.png").is_file() and "wrote" in capsys.readouterr().out


def test_report_of_a_directory_without_a_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) != 0
    err = " ".join(capsys.readouterr().err.split())  # (wrapped at 100 columns: where depends on the tmp path)
    assert f"there is no directory {tmp_path / 'nothing'}" in err, err  # (the directory named, not a file in it)
