"""`longctx bench comm --cluster NODESxRANKS --inter-ratio R`: the slow-link modes of issue 50 on an
emulated cluster, in one process group, on the same model and data.

Every mode runs the real training step (the Trainer's, gloo) while bench/emulated_link.py makes each
collective take the time the modelled links would: ranks placed RANKS to a node, each with a link
inside its node (--intra-gbps, GB/s per rank, one direction) and one to other nodes (--inter-ratio
times that). FSDP's own all-gathers and reduce-scatters go through job/comm.py for the emulation
(parallel/fsdp/quantized.py's Counted*: the same collectives, paced), so plain FSDP and ZeRO++ are
measured on the same links. Modes:

- fsdp: one FSDP group over every rank (synchronous data parallelism across the nodes);
- hpz, qwz, qgz, zeropp (all three): parallel.zero_pp, nodes of RANKS ranks;
- co2: one replica per node (parallel.dp_replicate = NODES, FSDP inside it), train.co2_local_steps
  local steps per round, the outer all-reduce overlapped with the next round;
- three_level (with --group-ranks G: a third, fastest link level of G-rank groups inside each node,
  Frontier's GCD pairs; the link between a node's groups is --middle-ratio of it): zeropp with hpZ's
  secondary partition over a group (parallel.hpz_ranks = G), so backward's gathers stay on the fastest
  level. Every mode then runs on the three-level links.

Per mode: a warm-up step (co2: co2_overlap_steps of them), then --timed steps (a multiple of co2's
round; `timed_steps`: for co2 a window holding as many merges as round ends). step_s is the mean step of
the slowest rank; exposed_s the largest time a rank was blocked on a link per step; inter_node_bytes and
intra_node_bytes what every rank put on a hop across / inside nodes, per step (their closed forms:
bench/comm_bytes.py, docs/parallelism.md). With --steps N each mode also trains N steps from the
same initialisation and reports final_loss (the mean of the last 10) and its losses; --plot draws
them. JSON on stdout, progress on stderr.
"""

from __future__ import annotations

import dataclasses
import math
import time
from datetime import date

import torch
import torch.distributed as dist

from .. import strict_json
from ..config import load_config
from ..costs.link_bytes import fsdp_unit
from ..errors import ConfigError
from ..job import comm
from ..job.devices import machine_record
from ..job.spawn import run_spawned
from ..progress import speaker
from .comm_bytes import PARTS, Unit, step_bytes
from .emulated_link import LinkProfile, emulate, parse_cluster

MODES = ("fsdp", "hpz", "qwz", "qgz", "zeropp", "co2", "three_level")
say = speaker("[bench comm --cluster] ")


def add_arguments(p) -> None:
    p.add_argument("--cluster", required=True, help="NODESxRANKS, e.g. 2x4: ranks placed RANKS to a node")
    p.add_argument("--inter-ratio", type=float, default=0.125,
                   help="inter-node / intra-node bandwidth, in (0, 1] (default 1/8)")
    p.add_argument("--intra-gbps", type=float, default=1.0,
                   help="emulated link inside a node, GB/s per rank and direction (default 1: slow enough that "
                        "this CPU's compute does not hide every transfer; the ratios are what carry over)")
    p.add_argument("--group-ranks", type=int, default=0,
                   help="a third link level: groups of this many ranks inside a node, linked at --intra-gbps "
                        "(0 = two levels); adds the three_level mode")
    p.add_argument("--middle-ratio", type=float, default=0.25,
                   help="with --group-ranks: the link between a node's groups / the link inside a group, in "
                        "[--inter-ratio, 1] (default 1/4)")
    p.add_argument("--modes", default="", help=f"comma-separated, of {', '.join(MODES)} (default: all; "
                                               f"three_level only with --group-ranks)")
    p.add_argument("--model", default="debug", help="model preset (default debug; small-100m for the issue's run)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence, one sequence per rank and step")
    p.add_argument("--timed", type=int, default=8, help="timed steps per mode after a warm-up (default 8)")
    p.add_argument("--co2-local-steps", type=int, default=4, help="co2's local steps per round (default 4)")
    p.add_argument("--co2-overlap-steps", type=int, default=0,
                   help="co2's train.co2_overlap_steps: steps after a round end at which its average is merged "
                        "(default 0 = the local steps, CO2's full overlap)")
    p.add_argument("--steps", type=int, default=0, help="also train each mode this many steps: final_loss")
    p.add_argument("--zero-pp-kernels", choices=("auto", "compiled", "eager"), default="compiled",
                   help="parallel.zero_pp_kernels for the qwz / qgz modes (default compiled, as a GPU run's auto: "
                        "one fused pass; compiled in the untimed warm-up; eager where no C++ compiler is)")
    p.add_argument("--plot", default="", help="with --steps: the PNG of the loss curves")


def mode_overrides(mode: str, nodes: int, ranks: int, spec: dict) -> list[str]:
    """The config of `mode` on the cluster (the model, data and batch are every mode's)."""
    base = [f"--model.preset={spec['model']}", f"--train.seq_len={spec['seq_len']}",
            f"--train.global_batch={nodes * ranks}", "--train.eval_interval=0", "--metrics.plots=false",
            "--metrics.progress=false", "--data.max_docs=300", "--train.warmup_steps=2",
            # (one step past the timed ones: a run's last step does more, e.g. co2's final average)
            f"--train.steps={max(spec['steps'], timed_steps(mode, spec)[-1] + 1)}",
            f"--parallel.ranks_per_node={ranks}",
            f"--model.max_seq_len={max(spec['seq_len'], 256)}", f"--parallel.zero_pp_kernels={spec['kernels']}"]
    extra = {"fsdp": [], "hpz": ["--parallel.zero_pp=hpz"], "qwz": ["--parallel.zero_pp=qwz"],
             "qgz": ["--parallel.zero_pp=qgz"], "zeropp": ["--parallel.zero_pp=hpz,qwz,qgz"],
             "co2": [f"--parallel.dp_replicate={nodes}", "--train.data_parallel=co2",
                     f"--train.co2_local_steps={spec['local_steps']}",
                     f"--train.co2_overlap_steps={spec.get('overlap_steps', 0)}"],
             "three_level": ["--parallel.zero_pp=hpz,qwz,qgz", f"--parallel.hpz_ranks={spec['group_ranks']}"]}[mode]
    return [*base, *extra]


def timed_steps(mode: str, spec: dict) -> range:
    """The steps a mode is timed over: spec["timed"] of them after a warm-up. Under co2 a round ends
    every local_steps (H) steps and its average is merged d = co2_overlap_steps (H by default) steps
    later, where an all-reduce not yet done is waited for (exposed). A window from step 2 holds
    timed / H round ends but, for d >= 2, one merge fewer: the last round's merge falls after it, and
    its wait (the exposed part of the outer all-reduce) went uncounted. Starting the window at step
    d + 1 puts timed / H round ends and their merges in it for any d in 1..H (d = 1: from step 2)."""
    first = 1 + ((spec.get("overlap_steps") or spec["local_steps"]) if mode == "co2" else 1)
    return range(first, first + spec["timed"])


def units_of(model, group: int, node: int, hpz: int = 0, even: bool = True) -> list[Unit]:
    """The FSDP units' shards per rank, from the parameters' shapes as FSDP2 cuts and pads them (costs/link_bytes.py
    fsdp_unit; `even` False under hpz: dim 0), independent of what the links counted."""
    units, in_blocks = [], set()
    for members in model.grad_bucket_plan.groups():
        params = [p for i in members for p in model.layers[i].parameters()]
        in_blocks.update(id(p) for p in params)
        units.append(fsdp_unit([p.shape for p in params], group, node, hpz, even))
    root = [p.shape for p in model.parameters() if id(p) not in in_blocks]
    return [*units, fsdp_unit(root, group, node, even=even, root=True)]


def _time_mode(mode: str, spec: dict, profile: LinkProfile) -> dict:
    from ..train.trainer import Trainer

    nodes, ranks = spec["nodes"], spec["ranks"]
    cfg = load_config(None, mode_overrides(mode, nodes, ranks, spec) + [f"--train.run_dir={spec['work']}/{mode}"])
    with emulate(profile) as emu:
        trainer = Trainer(cfg, log=lambda *a, **k: None)
        window = timed_steps(mode, spec)
        # the warm-up (FSDP's lazy set-up, the optimizer's state; co2: up to its first merge point)
        losses = [float(trainer.step(step)[0]) for step in range(1, window[0])]
        exposed, hops, started = emu.exposed_s, dict(emu.hops), time.perf_counter()
        for step in window:
            losses.append(float(trainer.step(step)[0]))
        seconds = time.perf_counter() - started
        exposed, moved = emu.exposed_s - exposed, [emu.hops[k] - hops[k] for k in ("inter", "intra", "group")]
        for step in range(window[-1] + 1, spec["steps"] + 1):
            losses.append(float(trainer.step(step)[0]))
        if trainer.co2 is not None:
            trainer.co2.run_end()
    world = comm.world_mesh()
    slowest = comm.all_reduce(torch.tensor([seconds, exposed], dtype=torch.float64), world, op=dist.ReduceOp.MAX)
    total = comm.all_reduce(torch.tensor(moved, dtype=torch.float64), world)
    group = nodes * ranks if mode != "co2" else ranks
    per_step = [float(v) / spec["timed"] for v in total]
    out = {"step_s": float(slowest[0]) / spec["timed"], "exposed_s": float(slowest[1]) / spec["timed"],
           "inter_node_bytes": per_step[0], "intra_node_bytes": per_step[1] + per_step[2],
           "intra_group_bytes": per_step[2]}
    hpz = spec["group_ranks"] if mode == "three_level" else 0
    units = units_of(trainer.model, group, ranks, hpz, even="hpz" not in PARTS[mode])
    out["closed_form"] = step_bytes(mode, units, nodes, ranks, cfg.parallel.zero_pp_block, spec["local_steps"],
                                    spec["group_ranks"], hpz)
    if spec["steps"]:
        out["final_loss"] = sum(losses[-10:]) / len(losses[-10:])
        out["losses"] = losses
    return out


def _rank(spec: dict) -> dict:
    fastest, group = spec["intra_gbps"] * 1e9, spec["group_ranks"]
    profile = LinkProfile(spec["ranks"], fastest * (spec["middle_ratio"] if group else 1.0),
                          fastest * spec["inter_ratio"], ranks_per_group=group,
                          group_bytes_per_s=fastest if group else 0.0)
    result = {"profile": dataclasses.asdict(profile), "modes": {}}
    for mode in spec["modes"]:
        if dist.get_rank() == 0:
            say(f"{mode} ...")
        result["modes"][mode] = _time_mode(mode, spec, profile)
    return result


def main(args) -> int:
    nodes, ranks = parse_cluster(args.cluster, min_nodes=2)  # (one node has no slow link)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()] or [
        m for m in MODES if m != "three_level" or args.group_ranks]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ConfigError(f"unknown --modes {unknown}; choose from {', '.join(MODES)}.")
    twice = sorted({m for m in modes if modes.count(m) > 1})  # (the second run found the first's run directory)
    if twice:
        raise ConfigError(f"--modes names {', '.join(twice)} more than once; give each mode once.")
    if args.group_ranks and (args.group_ranks < 2 or ranks % args.group_ranks):
        raise ConfigError(f"--group-ranks {args.group_ranks} must split a node of {ranks} ranks "
                          f"into groups of 2 or more.")
    if "three_level" in modes and not args.group_ranks:
        raise ConfigError("three_level needs a third link level: give --group-ranks G.")
    if args.timed < 1 or args.co2_local_steps < 1:  # (else no step timed, or a division by zero)
        raise ConfigError(f"--timed {args.timed} and --co2-local-steps {args.co2_local_steps} "
                          f"must each be at least 1 (e.g. --timed 8 --co2-local-steps 4).")
    if "co2" in modes and not 0 <= args.co2_overlap_steps <= args.co2_local_steps:  # (else co2's config refuses
        raise ConfigError(f"--co2-overlap-steps {args.co2_overlap_steps}: 0 (= the local steps) or 1.."  # it in
                          f"--co2-local-steps = {args.co2_local_steps}.")  # the ranks, after the other modes ran)
    timed = math.ceil(args.timed / args.co2_local_steps) * args.co2_local_steps  # whole co2 rounds
    needed = max(timed_steps(m, dict(timed=timed, local_steps=args.co2_local_steps,
                                     overlap_steps=args.co2_overlap_steps))[-1] + 1 for m in modes)
    if args.plot and not args.steps:  # (the curves are of the --steps run: without one no PNG was written, unsaid)
        raise ConfigError(f"--plot {args.plot} draws the loss curves of the --steps run; add --steps "
                          f"{max(needed, 300)} (e.g.), or drop --plot.")
    if 0 < args.steps < needed:  # (fewer: the run would train `needed` steps and report their losses as N's)
        raise ConfigError(f"--steps {args.steps} is fewer than the warm-up, the {timed} timed "
                          f"steps and one more ({needed}); give --steps {needed} or more, or 0.")
    import tempfile

    spec = dict(nodes=nodes, ranks=ranks, modes=modes, model=args.model, seq_len=args.seq_len, timed=timed,
                steps=args.steps, local_steps=args.co2_local_steps, overlap_steps=args.co2_overlap_steps,
                intra_gbps=args.intra_gbps, inter_ratio=args.inter_ratio, group_ranks=args.group_ranks,
                middle_ratio=args.middle_ratio, kernels=args.zero_pp_kernels)
    check_modes(spec)
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as work:
        result = run_spawned(nodes * ranks, _rank, {**spec, "work": work}, timeout=4 * 3600)[0]
    out = {"bench": "comm", "date": date.today().isoformat(), "cluster": f"{nodes}x{ranks}", "model": args.model,
           "seq_len": args.seq_len, "timed_steps": timed,
           "co2_local_steps": args.co2_local_steps, "co2_overlap_steps": args.co2_overlap_steps or args.co2_local_steps,
           "zero_pp_kernels": args.zero_pp_kernels,
           **result, "ratios": _ratios(result["modes"]),
           "machine": machine_record()}
    print(strict_json.dumps(out, indent=1), flush=True)  # (first: a plot that fails does not lose the figures)
    if args.plot and args.steps:
        _plot(result["modes"], args.plot)
    return 0


def check_modes(spec: dict) -> None:
    """Each mode's config on the cluster, checked as its ranks would (config rules, layout) before any rank
    starts: a --seq-len the balanced layout cannot cut was every rank's traceback after the spawn."""
    from ..job.checks import check_layout

    for mode in spec["modes"]:
        try:
            check_layout(load_config(None, mode_overrides(mode, spec["nodes"], spec["ranks"], spec)),
                         spec["nodes"] * spec["ranks"])
        except ConfigError as e:
            raise ConfigError(f"mode {mode} on --cluster {spec['nodes']}x{spec['ranks']}: {e}") from None


def _ratios(modes: dict) -> dict:
    base = modes.get("fsdp")
    if base is None:
        return {}
    out = {f"{m}/fsdp": {"step_s": r["step_s"] / base["step_s"],
                         "inter_node_bytes": r["inter_node_bytes"] / max(base["inter_node_bytes"], 1)}
           for m, r in modes.items() if m != "fsdp"}
    if "three_level" in modes and "zeropp" in modes:
        out["three_level/zeropp"] = {"step_s": modes["three_level"]["step_s"] / modes["zeropp"]["step_s"]}
    return out


def _plot(modes: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in modes.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=mode)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
