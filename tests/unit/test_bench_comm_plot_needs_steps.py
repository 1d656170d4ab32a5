"""`longctx bench comm --plot PNG` draws the loss curves of its --steps run; without --steps it wrote no PNG and
said nothing (docs/parallelism.md: `[--steps 300 --plot loss.png]`). It is refused before any rank starts."""
import argparse

import pytest

from longctx.bench import comm_cluster
from longctx.errors import ConfigError


def _args(*argv):
    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    return p.parse_args(["--cluster", "2x1", *argv])


def test_plot_without_steps_is_refused(monkeypatch):
    monkeypatch.setattr(comm_cluster, "run_spawned", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(ConfigError, match="--plot .* --steps"):
        comm_cluster.main(_args("--plot", "loss.png"))
