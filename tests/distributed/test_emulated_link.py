"""The emulated link (bench/emulated_link.py): a lone transfer takes latency + bytes / bandwidth
(within 10%), asynchronous transfers hide behind computation and queue behind each other on a link,
and inter-node bytes go at the inter-node bandwidth."""

import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from longctx.bench.emulated_link import LinkEmulator, LinkProfile, emulate
from longctx.job import comm
from longctx.job.spawn import run_spawned

MB = 1e6
# slow enough that gloo's own time (well under a millisecond for these sizes) is noise
PROFILE = dict(intra_bytes_per_s=20 * MB, inter_bytes_per_s=5 * MB, intra_latency_s=0.01, inter_latency_s=0.02)
ROW = 1000  # floats: 4,000 bytes a row


def test_a_transfer_occupies_each_link_for_latency_plus_bytes_over_bandwidth():
    emu = LinkEmulator(LinkProfile(ranks_per_node=2, **PROFILE), rank=0)
    # peer 1 shares node 0; peers 2, 3 are on node 1: 4 MB inside the node, 1 MB + 2 MB across it
    done = emu.post({1: (4_000_000, 1_000_000), 2: (1_000_000, 0), 3: (0, 2_000_000), 0: (9, 9)}, now=100.0)
    intra, inter = 0.01 + 4_000_000 / (20 * MB), 0.02 + 2_000_000 / (5 * MB)
    assert done == pytest.approx(100.0 + max(intra, inter))
    assert emu.free_at == pytest.approx({"group": 0.0, "intra": 100.0 + intra, "inter": 100.0 + inter})
    # the next transfer on the inter-node link queues behind the first
    assert emu.post({2: (500_000, 500_000)}, now=100.0) == pytest.approx(100.0 + inter + 0.02 + 0.1)


def test_three_levels_put_each_peer_on_its_link_and_a_ring_on_its_slowest():
    """Nodes of 4 ranks in groups of 2: peer 1 shares rank 0's group, peer 2 its node, peer 4 neither."""
    profile = LinkProfile(ranks_per_node=4, ranks_per_group=2, group_bytes_per_s=80 * MB, group_latency_s=0.005,
                          **PROFILE)
    emu = LinkEmulator(profile, rank=0)
    done = emu.post({1: (8_000_000, 0), 2: (2_000_000, 0), 4: (500_000, 0)}, now=0.0)
    assert emu.free_at == pytest.approx({"group": 0.005 + 0.1, "intra": 0.01 + 0.1, "inter": 0.02 + 0.1})
    assert done == pytest.approx(0.12) and emu.hops == {"group": 8_000_000, "intra": 2_000_000, "inter": 500_000}
    assert [profile.slowest(r) for r in ([0, 1], [0, 1, 2, 3], [0, 4])] == ["group", "intra", "inter"]
    ring = LinkEmulator(profile, rank=1)  # a ring over the node: rank 1's successor is rank 2 (another group)
    assert ring.post_ring([0, 1, 2, 3], 1_000_000, now=0.0) == pytest.approx(0.01 + 0.05)
    assert ring.hops == {"group": 0, "intra": 1_000_000, "inter": 0}


def _timings(rows_per_peer: int, ranks_per_node: int, repeats: int = 8):
    """Each figure the least of `repeats` tries: a measured time is the link's modelled time plus whatever the
    machine adds (a rank descheduled after the barrier, so its peer waits for it in the real transfer; an
    oversleep), never less, and on a loaded 2-core machine one try in several takes tens of ms more (8 tries, ~5 s:
    3 were not enough at a load of 30-70, where the best lone transfer of 3 took 0.19 s for the 0.10 s modelled)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("expert",))["expert"]
    x = torch.ones(2 * rows_per_peer, ROW)
    rows = [rows_per_peer, rows_per_peer]
    comm.all_to_all_v(x, mesh, rows, rows)  # warm-up, not emulated
    with emulate(LinkProfile(ranks_per_node=ranks_per_node, **PROFILE)) as emu:
        tries = [_timed_once(emu, mesh, x, rows, rows_per_peer) for _ in range(repeats)]
    out = {k: min(t[k] for t in tries) for k in ("blocking_s", "two_s", "all_reduce_s")}
    # the asynchronous figures belong together (the transfer against the computation of the same try): the
    # try that ran closest to its model
    out.update(min(({k: t[k] for k in ASYNC} for t in tries),
                   key=lambda t: t["async_s"] - max(0.1, t["async_issue_s"] + t["computed_s"])))
    return out


ASYNC = ("computed_s", "async_s", "async_issue_s", "async_exposed_s")


def _timed_once(emu, mesh, x, rows, rows_per_peer):
    out = {}
    comm.barrier(mesh)
    t0 = time.monotonic()
    got = comm.all_to_all_v(x, mesh, rows, rows)
    out["blocking_s"] = time.monotonic() - t0
    assert torch.equal(got, x)
    comm.barrier(mesh)
    t0 = time.monotonic()
    pending = comm.all_to_all_v_async(x, mesh, rows, rows)
    issued = time.monotonic() - t0
    t1 = time.monotonic()
    time.sleep(0.05)  # computation meanwhile
    out["computed_s"] = time.monotonic() - t1  # (a loaded machine may oversleep)
    before = emu.exposed_s
    pending.wait()
    out["async_s"], out["async_issue_s"] = time.monotonic() - t0, issued
    out["async_exposed_s"] = emu.exposed_s - before
    comm.barrier(mesh)
    t0 = time.monotonic()
    first, second = (comm.all_to_all_v_async(x, mesh, rows, rows) for _ in range(2))
    first.wait()
    second.wait()
    out["two_s"] = time.monotonic() - t0
    t = torch.ones(rows_per_peer, ROW)
    comm.barrier(mesh)
    t0 = time.monotonic()
    comm.all_reduce(t, mesh)
    out["all_reduce_s"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def inter():  # 2 ranks on 2 nodes: 100 rows of 4 KB = 0.4 MB each way
    return run_spawned(2, _timings, 100, 1)


@pytest.fixture(scope="module")
def intra():
    return run_spawned(2, _timings, 100, 2)


def test_a_lone_transfer_takes_latency_plus_bytes_over_bandwidth(inter, intra):
    for rank in range(2):
        assert inter[rank]["blocking_s"] == pytest.approx(0.02 + 0.4 * MB / (5 * MB), rel=0.1)   # 0.1 s
        assert intra[rank]["blocking_s"] == pytest.approx(0.01 + 0.4 * MB / (20 * MB), rel=0.1)  # 0.03 s
        # a ring all-reduce of 0.4 MB over 2 ranks moves 2 (n-1)/n of it through each rank
        assert inter[rank]["all_reduce_s"] == pytest.approx(0.02 + 0.4 * MB / (5 * MB), rel=0.1)


def test_an_asynchronous_transfer_hides_behind_computation_and_transfers_queue(inter):
    for r in inter:
        assert r["async_issue_s"] < 0.01  # issuing does not wait for the link
        hidden = r["async_issue_s"] + r["computed_s"]  # the transfer ran under these
        assert r["async_s"] == pytest.approx(max(0.1, hidden), rel=0.1)  # 0.05 s of it under the computation
        assert r["async_exposed_s"] == pytest.approx(max(0.1 - hidden, 0.0), abs=0.01)
        assert r["async_exposed_s"] < 0.08  # well under the whole transfer
        assert r["two_s"] == pytest.approx(0.2, rel=0.1)  # the second queues behind the first
