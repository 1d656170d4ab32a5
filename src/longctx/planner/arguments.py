"""`longctx plan`'s flags and their value parsers (planner/cli.py runs the command).

Only argparse and the errors are imported at module level: cli.py builds this parser for every
`longctx` command (see planner/cli.py's docstring).
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError


def offload_fractions(text: str) -> tuple[float, ...]:
    if text.strip().lower() in ("", "none", "0"):
        return ()
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--offload takes comma-separated fractions such as 0.25,0.5,1 (or none), "
                          f"got '{text}'.") from None
    bad = [v for v in vals if not 0 <= v <= 1]
    if bad:
        raise ConfigError(f"offload fractions must be in [0, 1], got {bad}.")
    return tuple(v for v in vals if v > 0)


def int_list(text: str, flag: str, minimum: int = 0) -> tuple[int, ...]:
    """Comma-separated integers, with K / M suffixes (powers of 1024)."""
    vals = []
    for x in text.split(","):
        s = x.strip().upper()
        mult = {"K": 2**10, "M": 2**20}.get(s[-1:], 1)
        try:
            vals.append(int(s[:-1] if mult > 1 else s) * mult)
        except ValueError:
            raise ConfigError(f"{flag} takes comma-separated integers, got '{text}'.") from None
    if not vals or any(v < minimum for v in vals):
        raise ConfigError(f"{flag} values must be integers >= {minimum}, got '{text}'.")
    return tuple(vals)


def expert_skew(text: str) -> float:
    """--expert-skew: a number >= 1, or max (the most routing allows: infinity, bounded per degree)."""
    if str(text).strip().lower() == "max":
        return float("inf")
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--expert-skew takes a number >= 1 (the most loaded expert rank's routed rows over an "
                          f"even share) or max; got '{text}'.") from None


def take_override(overrides: list[str], dotted: str) -> tuple[list[str], str | None]:
    """(the overrides without `--dotted=VALUE` / `--dotted VALUE`, its last VALUE or None): a config key the plan
    chooses from its own flag, given as an override (the last one wins, as config overrides do)."""
    rest, value, i = [], None, 0
    while i < len(overrides):
        arg = overrides[i]
        if arg.split("=", 1)[0] == f"--{dotted}":
            if "=" in arg:
                value, i = arg.split("=", 1)[1], i + 1
            else:
                value, i = (overrides[i + 1] if i + 1 < len(overrides) else ""), i + 2
            continue
        rest.append(arg)
        i += 1
    return rest, value


DEFAULT_OUT = "plan.toml"  # --out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..costs.hardware import hardware_names

    p.add_argument("--model", default="debug", help="model preset (config model.preset), e.g. llama3-8b, or "
                                                     "hf:DIR to read the shapes of a local Hugging Face config.json")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (ranks) in the job")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (which groups get fast links)")
    p.add_argument("--hardware", default=None, metavar="NAME|FILE.toml",
                   help=f"hardware to plan for: a preset ({', '.join(hardware_names())}; cpu-measured calibrates "
                        "this machine) or a TOML file with a [hardware] table (base = \"h100\" + fields); "
                        "default h100")
    p.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                   help="override one hardware field, e.g. --hw host_memory_gib=1024 (repeatable)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (GEMM and attention FLOP/s, gloo bandwidth) and plan for it")
    p.add_argument("--calibrate-out", default=None, help="write the calibrated hardware as TOML (for --hardware)")
    p.add_argument("--seq-len", default=None, help="tokens per sequence; K = 1024, M = 1048576 (e.g. 1M, 208K)")
    p.add_argument("--global-batch", type=int, default=0,
                   help="sequences per optimizer step over the whole job (default: --gpus)")
    p.add_argument("--micro-batch", default="1,2,4,8",
                   help="micro-batch sizes to try: sequences per data-parallel rank in one forward/backward "
                        "(grad_accum = global batch / (data-parallel degree x micro-batch))")
    p.add_argument("--recompute", default="none,full,selective",
                   help="activation recomputation policies to try (none, full, selective)")
    p.add_argument("--offload", default="0.125,0.25,0.5,0.75,1",
                   help="offload fractions to try with selective (and 0.5,1 of them with full), or none")
    p.add_argument("--model-states", default="device,host_optimizer,host",
                   help="memory.model_states tiers to try (device, host_optimizer, host); each candidate takes the "
                        "first that fits, in that order (a host tier adds host-link and host AdamW time)")
    p.add_argument("--offload-skip-last", type=int, default=1, help="last blocks never offloaded")
    p.add_argument("--loss-chunk", default=None, help="LM-head/loss chunk sizes to try (0 = full logits)")
    p.add_argument("--block-chunk", default="0,16K",
                   help="token chunk sizes of the blocks' token-wise parts to try with full/selective (0 = whole)")
    _add_expert_arguments(p)
    p.add_argument("--store", default=None, metavar="DIR",
                   help="a data store (longctx data build) at --seq-len: the attention work is taken from its "
                        "documents (doc_work: visible same-document pairs over plain causal ones, from at most "
                        "2,000 of its samples) and the written config trains it (data.path); default: one "
                        "document per sequence (doc_work 1.0)")
    p.add_argument("--allow", default="", metavar="co2",
                   help="lossy choices the plan may make: co2 (train.data_parallel = co2, local rounds whose outer "
                        "all-reduce hides under H steps; it changes convergence). Without it co2 plans are "
                        "estimated and reported beside the plan, never chosen")
    p.add_argument("--co2-local-steps", default="2,4,8", metavar="H,...",
                   help="train.co2_local_steps values to try for co2 plans: the smallest that hides the outer "
                        "all-reduce is taken")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    p.add_argument("--out", default=DEFAULT_OUT, help="where the best plan's config is written")
    p.add_argument("--no-write", action="store_true", help="do not write the config")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--validate", action="store_true",
                   help="run the CPU validation (predicted vs measured bytes, activations, step-time ranking)")
    p.add_argument("--anchors", action="store_true", help="check the published feasibility anchors")


def _add_expert_arguments(p: argparse.ArgumentParser) -> None:
    """The MoE flags: expert-parallel degrees, the planned skew, expert chunks, FlexMoE copy slots."""
    p.add_argument("--expert", default=None, metavar="DEGREES",
                   help="MoE models: expert-parallel degrees to try, each dividing the experts and the GPUs "
                        "(default: 1 and the largest such degree whose expert group stays in one node)")
    p.add_argument("--expert-skew", default="2", metavar="X|max",
                   help="MoE models under expert parallelism: the most loaded rank's routed rows over an even "
                        "share that memory and time are planned for (default 2; max: the most routing allows)")
    p.add_argument("--expert-chunk", default="0,16K",
                   help="MoE models: memory.expert_chunk values to try (rows the experts run at a time)")
    p.add_argument("--expert-replicas", default="0", metavar="SLOTS",
                   help="MoE models under expert parallelism: FlexMoE copy slots per rank to try "
                        "(parallel.expert_replicas; e.g. 0,1,2): their memory, their weights over the links and the "
                        "load they take off the most loaded rank under --expert-skew (default 0: no copies)")
