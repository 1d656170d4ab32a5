"""An emulated network for benchmarks: collectives that take the time a modelled cluster's links would.

On one small machine every rank is a local process and gloo moves bytes through shared memory in
microseconds, so nothing shows what overlapping communication with compute, or sending less across
nodes, buys. Under `emulate(profile)` each collective of job/comm.py on an emulated mesh dim
still runs for real (the same code path, the same bytes), and then completes no earlier than the
modelled link would have delivered it:

- ranks are placed `ranks_per_node` to a node by global rank;
- a rank has two full-duplex links, one inside its node and one to other nodes, each with a
  latency and a bandwidth (bytes/s, one direction, per rank);
- a transfer occupies each link it uses for `latency + max(bytes sent, bytes received) / bandwidth`
  and queues behind the transfers already on that link, so a transfer is done when its slowest
  link is; an all-to-all splits its bytes by peer, the ring collectives (all-gather, all-reduce)
  run at the speed of the slowest link their group spans;
- the time is wall time and the transfer is asynchronous like a NIC's: a blocking collective
  returns at its completion time; an asynchronous one (`comm.all_to_all_v_async`) returns at once
  and its `wait()` sleeps only for whatever of it is still in flight, so computation issued in
  between hides it.

Time a rank spends blocked in a collective (in `wait()` or a blocking call) is counted as exposed
communication (`exposed_seconds()`): the figure an overlapped schedule lowers.

A profile may also emulate the devices' compute (`compute_flops` > 0): the expert GEMMs (comm.paced,
which the expert dispatcher calls) then take at least flops / compute_flops of wall time, forward
and backward. Without it, ranks that share a few cores lend them to each other: a rank that waits
frees a core for the rank that computes, so a straggler's extra work costs the group nothing, which
is the opposite of a cluster (each rank its own device) and hides exactly what balancing the
experts' load buys.

The emulator is a link hook that job/comm.py offers (`comm.set_link_hook`), installed by `emulate`:
live code never imports this module.

This is for benchmarks only (`longctx bench moe`); training never turns it on, and on a real
cluster the benchmark runs without it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..job import comm


@dataclass(frozen=True)
class LinkProfile:
    ranks_per_node: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 10e-6
    dims: tuple[str, ...] = ()  # the mesh dims whose collectives are emulated (empty: all of them)
    compute_flops: float = 0.0  # an emulated device's FLOP/s for the expert GEMMs (0: as fast as they run here)
    # a third, fastest level (Frontier's GCD pairs): groups of this many ranks inside a node, linked at
    # group_bytes_per_s; intra_bytes_per_s is then the link between a node's groups (0: two levels)
    ranks_per_group: int = 0
    group_bytes_per_s: float = 0.0
    group_latency_s: float = 2e-6

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.intra_bytes_per_s <= 0 or self.inter_bytes_per_s <= 0:
            raise ValueError(f"an emulated link needs ranks_per_node >= 1 and positive bandwidths, got {self}")
        if self.ranks_per_group and (self.ranks_per_node % self.ranks_per_group or self.group_bytes_per_s <= 0):
            raise ValueError(f"a three-level link needs groups that split a node and a positive group bandwidth, "
                             f"got {self}")

    @classmethod
    def from_hardware(cls, hw, ranks_per_node: int, slowdown: float = 1.0, dims: tuple[str, ...] = (),
                      faster: float = 1.0, widen: float = 1.0, inter_ratio: float = 0.0) -> LinkProfile:
        """The links of a planner hardware (costs/hardware.py: intra_gbps, inter_gbps per GPU; a
        NIC latency of 5 us inside a node, 10 us across), `slowdown` times slower: set it to how
        much slower this machine computes than that hardware, so communication keeps the share of a
        step it has there. `faster` speeds latency and bandwidth up on purpose, `widen` bandwidth
        only (bytes that travel wider here than there, fp32 for bf16); `inter_ratio` > 0 sets the
        inter-node bandwidth to that fraction of the intra-node one."""
        intra = hw.intra_gbps * 1e9 / slowdown * faster * widen
        inter = intra * inter_ratio if inter_ratio else hw.inter_gbps * 1e9 / slowdown * faster * widen
        latency = slowdown / faster
        return cls(ranks_per_node, intra, inter, 5e-6 * latency, 10e-6 * latency, dims)

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def level(self, a: int, b: int) -> str:
        """The link between ranks a and b: "group" (same group, three levels only), "intra" or "inter"."""
        if self.node(a) != self.node(b):
            return "inter"
        if self.ranks_per_group and a // self.ranks_per_group == b // self.ranks_per_group:
            return "group"
        return "intra"

    def slowest(self, ranks: list[int]) -> str:
        """The slowest link a ring over `ranks` crosses."""
        if len({self.node(r) for r in ranks}) > 1:
            return "inter"
        if self.ranks_per_group and len({r // self.ranks_per_group for r in ranks}) == 1:
            return "group"
        return "intra"

    def link(self, name: str) -> tuple[float, float]:
        """(latency, bytes/s) of a link."""
        return {"group": (self.group_latency_s, self.group_bytes_per_s),
                "intra": (self.intra_latency_s, self.intra_bytes_per_s),
                "inter": (self.inter_latency_s, self.inter_bytes_per_s)}[name]


class LinkEmulator:
    """One rank's two links: when each is free, and the time this rank has been blocked on them."""

    def __init__(self, profile: LinkProfile, rank: int):
        self.profile, self.rank = profile, rank
        self.free_at = {"group": 0.0, "intra": 0.0, "inter": 0.0}
        self.exposed_s = 0.0
        self.transfers = 0
        self.sent = {"group": 0, "intra": 0, "inter": 0}  # bytes this rank sent over each link
        # bytes this rank put on a hop within / across nodes: an all-to-all's to each peer directly, a
        # ring collective's all to its successor in the ring (so a ring over k nodes crosses k times)
        self.hops = {"group": 0, "intra": 0, "inter": 0}

    def covers(self, dim: str) -> bool:
        return not self.profile.dims or dim in self.profile.dims

    def post(self, by_peer: dict[int, tuple[int, int]], now: float | None = None) -> float:
        """Put a transfer issued at `now` (default: now) on the links: {global peer rank: (bytes sent
        to it, bytes received from it)}; returns the monotonic time at which it is complete."""
        p = self.profile
        load = {"group": [0, 0], "intra": [0, 0], "inter": [0, 0]}
        for peer, (sent, received) in by_peer.items():
            if peer == self.rank:
                continue
            link = load[p.level(self.rank, peer)]
            link[0] += sent
            link[1] += received
        for name, (sent, _) in load.items():
            self.hops[name] += sent
        return self._occupy(load, now)

    def _occupy(self, load: dict, now: float | None) -> float:
        """Queue {link: [bytes sent, bytes received]} on this rank's links; the time all are done."""
        for name, (sent, _) in load.items():
            self.sent[name] += sent
        now = time.monotonic() if now is None else now
        done = now
        for name, (sent, received) in load.items():
            if not sent and not received:
                continue
            latency, bandwidth = self.profile.link(name)
            end = max(now, self.free_at[name]) + latency + max(sent, received) / bandwidth
            self.free_at[name] = end
            done = max(done, end)
        self.transfers += 1
        return done

    def post_ring(self, group_ranks: list[int], nbytes: float, now: float | None = None) -> float:
        """A ring collective over `group_ranks` moving `nbytes` through each rank: at the speed of
        the slowest link the ring crosses."""
        p = self.profile
        if len(group_ranks) < 2:
            return time.monotonic() if now is None else now
        ordered = sorted(group_ranks)
        successor = ordered[(ordered.index(self.rank) + 1) % len(ordered)]
        self.hops[p.level(self.rank, successor)] += int(nbytes)
        load = {"group": [0, 0], "intra": [0, 0], "inter": [0, 0]}
        load[p.slowest(group_ranks)] = [int(nbytes), int(nbytes)]
        return self._occupy(load, now)

    def wait_until(self, done: float, started: float | None = None) -> None:
        """Block until `done`; the blocked time since `started` (default: now) counts as exposed."""
        start = time.monotonic() if started is None else started
        left = done - time.monotonic()
        if left > 0:
            time.sleep(left)
        self.exposed_s += time.monotonic() - start

    def paced(self, run, x, flops: float):
        """run(x) (a block of `flops` forward FLOPs, twice that backward) taking at least the time an
        emulated device of the profile's compute_flops would; just run(x) otherwise."""
        if not self.profile.compute_flops:
            return run(x)
        seconds = flops / self.profile.compute_flops
        clock: dict = {}
        start = time.monotonic()
        if x.requires_grad:
            x = _BackwardEnds.apply(x, clock, 2 * seconds)
        y = run(x)
        _sleep_until(start + seconds)
        return _BackwardStarts.apply(y, clock) if y.requires_grad else y


def parse_cluster(text: str, min_nodes: int = 1) -> tuple[int, int]:
    """`--cluster NODESxRANKS` of a `longctx bench` command -> (nodes, ranks per node), or a ConfigError
    that says what to write."""
    try:
        nodes, ranks = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--cluster {text!r}: give NODESxRANKS, e.g. 2x4.") from None
    if nodes < min_nodes or ranks < 1:
        raise ConfigError(f"--cluster {text!r}: at least {min_nodes} node"
                          f"{'s' if min_nodes > 1 else ''} and 1 rank per node.")
    return nodes, ranks


def active() -> LinkEmulator | None:
    """The emulator installed as job/comm.py's link hook, if any."""
    hook = comm.link_hook()
    return hook if isinstance(hook, LinkEmulator) else None


@contextlib.contextmanager
def emulate(profile: LinkProfile):
    """Emulate `profile`'s links for the collectives of job/comm.py inside the block (this rank): the
    emulator is installed as comm's link hook, and the previous hook put back after."""
    emu = LinkEmulator(profile, dist.get_rank() if dist.is_initialized() else 0)
    previous = comm.set_link_hook(emu)
    try:
        yield emu
    finally:
        comm.set_link_hook(previous)


def exposed_seconds() -> float:
    """Seconds this rank has spent blocked on emulated collectives in the current `emulate` block."""
    emu = active()
    return 0.0 if emu is None else emu.exposed_s


class _BackwardStarts(torch.autograd.Function):
    """On a paced block's output: its backward (the first of the block's) notes the time."""

    @staticmethod
    def forward(ctx, y, clock):
        ctx.clock = clock
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock["start"] = time.monotonic()
        return grad, None


class _BackwardEnds(torch.autograd.Function):
    """On a paced block's input: its backward (the last of the block's) waits out the modelled time."""

    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _sleep_until(ctx.clock.get("start", time.monotonic()) + ctx.seconds)
        return grad, None, None


def _sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)
