"""`longctx bench comm`'s co2 mode (bench/comm_cluster.py _time_mode) times a window of steps that holds
as many merges as round ends: a merge is where CO2 waits for its outer all-reduce (its exposed time),
so a window that holds every send but misses a merge reports the all-reduce's bytes and not its wait.
The Trainer and the links are replaced by a recorder that replays OuterSync's real schedule
(step/co2.py step_done) and charges one second of exposed time per merge of a change in flight."""

import argparse
import types

import pytest
import torch

from longctx.bench import comm_cluster
from longctx.errors import ConfigError
from longctx.step.co2 import OuterSync


class _Links:
    """The emulator's figures _time_mode reads: exposed seconds and bytes per hop."""

    def __init__(self):
        self.exposed_s, self.hops = 0.0, {"inter": 0, "intra": 0, "group": 0}


class _Outer(OuterSync):
    """OuterSync's schedule; a send puts 1 byte across nodes, a merge of a change in flight waits 1 s."""

    def __init__(self, links: _Links, local_steps: int, overlap: int):  # (no parameters, no mesh)
        self.links, self.local_steps, self.overlap = links, local_steps, overlap or local_steps
        self.pending = self.arrived = None
        self.rounds = 0

    def merge(self, keep=None) -> None:
        if self.pending is not None:
            self.links.exposed_s += 1.0
            self.pending = None

    def end_round(self) -> None:
        self.links.hops["inter"] += 1
        self.pending, self.rounds = "sent", self.rounds + 1


def _time_co2(monkeypatch, tmp_path, local_steps: int, overlap: int, timed: int) -> tuple[dict, list[int], int]:
    links, ran, last = _Links(), [], {}

    class Trainer:
        def __init__(self, cfg, log):
            self.co2 = _Outer(links, local_steps, overlap)
            self.co2.run_end = lambda: None
            self.model = None

        def step(self, k):
            assert k < last["step"] or k > max(comm_cluster.timed_steps("co2", spec)), "the run's last step is timed"
            ran.append(k)
            self.co2.step_done(k)
            return torch.tensor(1.0), torch.tensor(1.0), 1e-3

    def load_config(_path, overrides):
        last["step"] = next(int(o.split("=")[1]) for o in overrides if o.startswith("--train.steps="))
        return types.SimpleNamespace(parallel=types.SimpleNamespace(zero_pp_block=512))

    import contextlib

    @contextlib.contextmanager
    def emulate(_profile):
        yield links

    monkeypatch.setattr("longctx.train.trainer.Trainer", Trainer)
    monkeypatch.setattr(comm_cluster, "load_config", load_config)
    monkeypatch.setattr(comm_cluster, "emulate", emulate)
    monkeypatch.setattr(comm_cluster, "units_of", lambda *a, **k: [])
    monkeypatch.setattr(comm_cluster, "step_bytes", lambda *a, **k: {})
    monkeypatch.setattr(comm_cluster.comm, "world_mesh", lambda: None)
    monkeypatch.setattr(comm_cluster.comm, "all_reduce", lambda x, mesh, op=None, label="": x)
    spec = dict(nodes=2, ranks=1, steps=0, timed=timed, local_steps=local_steps, overlap_steps=overlap,
                work=str(tmp_path), group_ranks=0, kernels="eager", model="debug", seq_len=64)
    return comm_cluster._time_mode("co2", spec, None), ran, last["step"]


@pytest.mark.parametrize(("local_steps", "overlap"),  # overlap 0: the default, = local_steps
                         [(h, d) for h in (1, 2, 4) for d in (0, 1, 2, 3, 4) if d <= h])
def test_co2_window_holds_each_round_end_and_its_merge(monkeypatch, tmp_path, local_steps, overlap):
    timed = 2 * local_steps
    out, ran, last = _time_co2(monkeypatch, tmp_path, local_steps, overlap, timed)
    rounds = timed // local_steps
    assert out["inter_node_bytes"] == rounds / timed  # one send per round: unchanged
    assert out["exposed_s"] == rounds / timed, "every round's merge (its wait) is inside the timed window"
    assert ran == list(range(1, ran[-1] + 1)) and ran[-1] < last  # steps in order; the last step untimed


def test_too_few_steps_for_the_window_are_refused(monkeypatch):
    """--steps N below the warm-up, the timed steps and one more would train more than N steps and
    report their losses as N's: refused before any rank starts."""
    monkeypatch.setattr(comm_cluster, "run_spawned", lambda *a, **k: pytest.fail("the benchmark started"))
    p = argparse.ArgumentParser()
    comm_cluster.add_arguments(p)
    args = p.parse_args(["--cluster", "2x1", "--timed", "4", "--co2-local-steps", "4", "--steps", "6"])
    with pytest.raises(ConfigError, match="--steps 6 is fewer"):
        comm_cluster.main(args)
