"""`longctx bench comm`: each mode's config is checked before any rank starts. An odd --seq-len (the balanced
layout cuts a sequence in 2 x ctx x head pieces) was a traceback from every rank after the spawn; a mode named
twice in --modes ran the first, then failed in the second on the first's run directory. Each is one clear
error now, and no rank is started."""

import argparse

import pytest

from longctx.bench import comm_cluster
from longctx.errors import ConfigError


class Spawned(Exception):
    pass


def _spawn(*_a, **_kw):
    raise Spawned


def _args(*argv):
    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    return p.parse_args(["--cluster", "2x2", *argv])


@pytest.mark.parametrize("argv, says", [(["--seq-len", "3"], "mode fsdp on --cluster 2x2: .*sequence length 3"),
                                        (["--modes", "fsdp,co2,fsdp"], "--modes names fsdp more than once")])
def test_a_mode_its_ranks_would_refuse_is_refused_before_they_start(monkeypatch, argv, says):
    monkeypatch.setattr(comm_cluster, "run_spawned", _spawn)
    with pytest.raises(ConfigError, match=says):
        comm_cluster.main(_args(*argv))


def test_every_mode_of_a_sound_request_passes_the_check(monkeypatch):
    monkeypatch.setattr(comm_cluster, "run_spawned", _spawn)
    with pytest.raises(Spawned):  # (checked, then the ranks would start)
        comm_cluster.main(_args("--group-ranks", "2", "--seq-len", "64"))
