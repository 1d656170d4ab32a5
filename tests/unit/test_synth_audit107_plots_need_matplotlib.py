"""Plots without matplotlib: a training run that would draw them is refused before any work; an eval's
plot is left out with a note, its JSON result kept.

matplotlib is imported only when the plots are written, at the end (train/report.py, eval/plots.py):
without it a long run trained and saved, then stopped on a ModuleNotFoundError traceback (exit 1, which a
requeue reads as a failure to run again); `longctx eval --output` likewise after its whole evaluation.
"""

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.eval import command
from longctx.train.setup import check_packages


@pytest.fixture
def no_matplotlib(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it raises ImportError, as when not installed)


def test_a_run_with_plots_is_refused_without_matplotlib(no_matplotlib):
    with pytest.raises(ConfigError, match="matplotlib.*--metrics.plots false"):
        check_packages(load_config(None, []))
    check_packages(load_config(None, ["--metrics.plots=false"]))  # (no plots: nothing needed)


def test_an_eval_plot_is_left_out_with_a_note_without_matplotlib(no_matplotlib, tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(command, "say", said.append)
    result = {"task": "passkey", "model": "m", "accuracy": 1.0,
              "results": [{"length": 64, "depth": 0.5, "accuracy": 1.0}]}
    args = SimpleNamespace(plot="", output=str(tmp_path / "out.json"))
    command._write(result, args)
    command._write_plot(result, args)  # (raised ModuleNotFoundError: the import is matplotlib's own)
    assert json.loads((tmp_path / "out.json").read_text())["accuracy"] == 1.0
    assert not (tmp_path / "out.png").exists()
    assert any("no plot written" in s and "matplotlib" in s for s in said), said
