"""Ctrl-C (or a SIGINT to the launcher, which torchrun passes on) under `longctx train --nproc N`: the launcher says
"stopped by SIGINT ..." once for the job; each of the N ranks printed "longctx train: interrupted" above it too
(seen: 2 lines on 2 ranks, then the launcher's). A process alone still says it."""

from __future__ import annotations

import pytest

from longctx import cli
from longctx.job.launch import ERROR_DIR_ENV


def _interrupted(_args, _overrides):
    raise KeyboardInterrupt


@pytest.mark.parametrize("launched", [True, False])
def test_an_interrupted_rank_leaves_the_word_to_its_launcher(launched, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_cmd_train", _interrupted)
    if launched:
        monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
        monkeypatch.setenv("RANK", "1")
    else:
        monkeypatch.delenv(ERROR_DIR_ENV, raising=False)
    assert cli.main(["train"]) == 130  # (the shell's code of a process SIGINT ended, either way)
    said = capsys.readouterr().err
    assert ("interrupted" in said) is not launched, said
