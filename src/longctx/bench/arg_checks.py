"""The sizes of every `longctx bench` command, checked before it builds a model or starts a rank.

A size of zero or less (a --seq-len 0, a --top-k above the experts, a --micro-batch 0) otherwise
surfaced from deep inside the work as a ZeroDivisionError, a rank killed by a signal, a reshape's
RuntimeError, or, worse, as figures of nothing (bench decode at --max-new-tokens 0 printed a speedup
of 0x). Each command's own checks (--repeats, --steps, --cluster, ...) stay in its module; these are
the ones its module left to the work.
"""

from __future__ import annotations

import math
import re

from ..errors import ConfigError

# per command: each flag (attribute) with the least value it takes
MINIMUM = {
    "generate": {"dim": 1, "layers": 1, "heads": 1, "kv_heads": 1, "ffn_dim": 1, "vocab": 1, "prompt_len": 1,
                 "new_tokens": 2, "prefill_chunk": 1},
    # (at least 2 new tokens: the first comes from the prefill's logits, so 1 makes no decode step to time)
    "decode": {"max_new_tokens": 2},
    "attention": {"world": 1, "head": 1, "ctx": 1, "window": 0, "micro_batch": 1, "heads": 1, "kv_heads": 1,
                  "head_dim": 1, "threads": 1, "first_sample": 0, "imbalance_samples": 0},
    "train": {"global_batch": 1},
    "memory": {"layers": 0, "micro_batch": 1, "skip_last": 0, "head": 1, "ctx": 1, "docs": 1, "loss_chunk": 0,
               "block_chunk": 0, "time_steps": 0, "attention_chunk": 0, "doc_len": 0},
    "moe": {"dim": 1, "experts": 1, "top_k": 1, "expert_dim": 0, "threads": 1, "tokens": 1, "layers": 0,
            "replicas": 1, "zipf": 0},
    "comm": {"seq_len": 2, "steps": 0},
}
# per command: comma-separated token counts (each a positive integer)
LENGTHS = {"generate": ("memory_lengths", "sharded_lengths"), "train": ("seq_len",), "memory": ("seq_len",),
           "moe": ("seq_len", "memory_seq_len")}
# the lists of LENGTHS that must name a length ('' is none only where a flag's help says so; bench moe's two each
# skip their part, refused together: _moe_lengths_problems)
NO_EMPTY = {("train", "seq_len"), ("memory", "seq_len")}


def check_bench_args(command: str, args) -> None:
    """`longctx bench COMMAND`'s sizes (args: its parsed flags); one error naming each bad one."""
    problems = [f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}"
                for name, least in MINIMUM.get(command, {}).items()
                if getattr(args, name, None) is not None and getattr(args, name) < least]
    for name in LENGTHS.get(command, ()):
        text = str(getattr(args, name, "") or "")
        if not text.strip() and (command, name) in NO_EMPTY and getattr(args, name, None) is not None \
                and not getattr(args, "max_seq", False):  # (bench memory --max-seq: '' = no per-length table)
            # (bench train: a ValueError traceback; bench memory and moe: a run that measured nothing)
            problems.append(f"--{name.replace('_', '-')} '' names no length: give one or more token counts, e.g. "
                            f"4096,8192")
            continue
        bad = [x for x in text.split(",") if not (x.strip().isdigit() and int(x) > 0)] if text.strip() else []
        if bad:
            problems.append(f"--{name.replace('_', '-')} {text!r}: {', '.join(map(repr, bad))} is not a positive "
                            f"token count (write e.g. 4096,8192)")
    problems += _structure(command, args)
    if problems:
        raise ConfigError(f"{'; '.join(problems)}.")  # (the CLI says "longctx bench X: error: ...")


def _structure(command: str, args) -> list[str]:
    """What a command's sizes must agree on (heads and their groups, a layout's degrees, a policy name)."""
    out = []
    if command in ("generate", "attention") and min(args.heads, args.kv_heads) >= 1 and args.heads % args.kv_heads:
        out.append(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if command == "generate" and min(args.dim, args.heads) >= 1 and args.dim % args.heads:
        out.append(f"--heads {args.heads} must divide --dim {args.dim} (the head size is dim / heads)")
    if command == "generate" and args.sharded and not re.fullmatch(r"[1-9]\d*x[1-9]\d*", args.sharded):
        out.append(f"--sharded {args.sharded!r}: write HxC, the head and ctx degrees, e.g. 1x4")
    elif command == "generate" and args.sharded and min(args.heads, args.kv_heads) >= 1:
        out += _sharded_heads_problems(args)
    if command == "generate" and args.compile != "false":
        out += _device_problems(args.device)
    if command == "attention":
        if args.seq_len is not None and args.seq_len < 2:
            out.append(f"--seq-len must be >= 2, got {args.seq_len}")
        if args.window > 0 and args.ctx >= 1 and args.ctx % args.window:
            out.append(f"--window {args.window} must be 0 (a plain ring) or divide --ctx {args.ctx}")
        unread = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in ("first_sample", "imbalance_samples")
                  if getattr(args, n) > 0]
        if unread and not str(args.docs or "").startswith("store:"):  # (else ignored, the figures of sample 0)
            out.append(f"{', '.join(unread)}: a store's samples, read only with --docs store:DIR")
    if command == "train":
        out += _train_problems(args)
    if command == "memory":
        out += _memory_problems(args)
    if command == "moe":
        out += _moe_problems(args)
    if command == "moe" and min(args.top_k, args.experts) >= 1:
        if args.top_k > args.experts:
            out.append(f"--top-k {args.top_k} is more than the {args.experts} --experts")
        skewed = "skewed" in args.routing.split(",") and not getattr(args, "cluster", "")  # (the runs that read it)
        if skewed and not 0 < args.skew_share <= 1 / args.top_k + 1e-9:  # (moe_common.skew's rule, before any run)
            out.append(f"--skew-share {args.skew_share}: expert 0's share of the choices, in (0, 1 / top-k = "
                       f"{1 / args.top_k:g}]")
    if command == "comm":
        out += _comm_problems(args)
    if command in ("generate", "moe", "memory", "attention", "decode"):
        from . import attention, decode, generate, memory, moe
        from .unread_flags import unread_flags

        module = {"generate": generate, "moe": moe, "memory": memory, "attention": attention, "decode": decode}[command]
        out += unread_flags(command, module, args)
    return out


def _memory_problems(args) -> list[str]:
    """bench memory's sizes: its policies, lengths under the layout, documents per length, the --max-seq probes."""
    from .memory import seq_lengths

    out = _policy_problems(args.policies) + _offload_without_blocks(args) + _preset_problems(args.preset)
    if args.probe and not re.fullmatch(r"[^:]+:[1-9]\d*", args.probe):  # (a ValueError traceback on unpacking)
        out.append(f"--probe {args.probe!r}: write POLICY:SEQ_LEN, e.g. selective:65536 (the probes --max-seq starts)")
    world = args.head * args.ctx
    if args.head >= 1 and args.ctx >= 1 and world > 1:  # (the default's length too: seq_lengths)
        bad = [x for x in seq_lengths(args).split(",") if x.strip().isdigit() and int(x) % (2 * world)]
        if bad:
            out.append(f"--seq-len {', '.join(bad)}: under head {args.head} x ctx {args.ctx} a length is a "
                       f"multiple of 2 x head x ctx = {2 * world} (the balanced layout's pieces)")
    short = [x for x in seq_lengths(args).split(",") if x.strip().isdigit() and 0 < int(x) < args.docs]
    if short:  # (else _batch's bounds repeat: documents of no token, the JSON's "docs" not what was packed)
        out.append(f"--docs {args.docs} documents do not fit in --seq-len {', '.join(short)}: each document "
                   f"is at least one token; give --docs {min(int(x) for x in short)} or less, or longer lengths")
    if args.device == "cuda":  # (auto: whichever there is)
        out += _device_problems(args.device)
    if args.max_seq and (world > 1 or args.no_backward):  # (the probes: one process, a whole step)
        unread = [f"--head {args.head} x --ctx {args.ctx}"] * (world > 1) + ["--no-backward"] * args.no_backward
        out.append(f"{' and '.join(unread)}: --max-seq probes a whole training step in one process and reads "
                   f"neither; run the per-length tables with them in a command of their own")
    return out


def _comm_problems(args) -> list[str]:
    """bench comm's link ratios, preset and plot path."""
    out = []
    for name in ("intra_gbps", "inter_ratio", "middle_ratio"):
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            out.append(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    out += _link_order_problems(args)
    from ..config.presets import MODEL_PRESETS

    if args.model not in MODEL_PRESETS:  # (else every rank's config traceback, after the spawn)
        out.append(f"--model {args.model}: choose among {', '.join(MODEL_PRESETS)}")
    from ..durable import check_output_path

    try:  # (the PNG is drawn after every mode ran: a missing directory lost the run's JSON to a traceback)
        check_output_path("--plot", args.plot, {})
    except ConfigError as e:
        out.append(str(e).rstrip("."))
    return out


def _link_order_problems(args) -> list[str]:
    """bench comm's links slow down outwards (emulated_link.LinkProfile.slowest times a ring by the link of
    the widest level it spans): a ratio above 1, or nodes linked faster than a node's groups, timed a ring
    that crosses the slower inner links at the faster outer one's speed, and reported the figures unsaid."""
    ratios = [args.inter_ratio, args.middle_ratio] if args.group_ranks else [args.inter_ratio]
    if not all(r > 0 and math.isfinite(r) for r in ratios):
        return []  # (said above)
    out = [f"--{name}-ratio {r:g} is above 1: the link it names would be faster than the one inside it (a ring "
           f"across both is timed at the outer link's speed); give a ratio in (0, 1]"
           for name, r in zip(("inter", "middle"), ratios) if r > 1]
    if args.group_ranks and args.inter_ratio > args.middle_ratio:
        out.append(f"--inter-ratio {args.inter_ratio:g} is above --middle-ratio {args.middle_ratio:g}: nodes would "
                   f"be linked faster than a node's groups; give --inter-ratio <= --middle-ratio")
    return out


def _train_problems(args) -> list[str]:
    """bench train's layouts, presets and the lengths each layout and preset takes."""
    from ..config.presets import MODEL_PRESETS
    from .train import LAYOUTS

    out = []

    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS]
    if unknown:
        out.append(f"--layouts {', '.join(unknown)}: choose among {', '.join(LAYOUTS)}")
    for layout in (x for x in args.layouts.split(",") if x in LAYOUTS):  # (else every row an error, rc 0)
        degree = {k.split("=")[0]: int(k.split("=")[1]) for k in LAYOUTS[layout][1]}
        split = degree.get("--parallel.head", 1) * degree.get("--parallel.ctx", 1)
        bad = [x for x in args.seq_len.split(",") if x.strip().isdigit() and int(x) % (2 * split)]
        if bad:
            out.append(f"--seq-len {', '.join(bad)}: layout {layout} needs a multiple of 2 x head x ctx = "
                       f"{2 * split}")
        dp = degree.get("--parallel.dp_shard", 1)
        if args.global_batch >= 1 and args.global_batch % dp:
            out.append(f"--global-batch {args.global_batch}: layout {layout} splits it over dp {dp}")
    unknown = [x for x in args.presets.split(",") if x not in MODEL_PRESETS]
    if unknown:  # (each run's `longctx train` refused it, written into the JSON as that row's error)
        out.append(f"--presets {', '.join(unknown)}: choose among "
                   f"{', '.join(MODEL_PRESETS)}")
    for preset in (x for x in args.presets.split(",") if x in MODEL_PRESETS):  # (else that row's error, rc 0)
        most = MODEL_PRESETS[preset].get("max_seq_len")
        long = [x for x in args.seq_len.split(",") if most and x.strip().isdigit() and int(x) > most]
        if long:
            out.append(f"--seq-len {', '.join(long)}: preset {preset} holds at most {most:,} tokens "
                       f"(its max_seq_len); give a shorter length or another preset")
    return out


def _device_problems(device: str) -> list[str]:
    """--device: cpu, or cuda (cuda:N) where this machine has a CUDA device."""
    if device == "cpu":
        return []
    if not device.startswith("cuda"):
        return [f"--device {device!r}: cpu or cuda"]
    import torch

    return [] if torch.cuda.is_available() else [f"--device {device}: no CUDA device is available here"]


def _moe_problems(args) -> list[str]:
    """bench moe's names and the --cluster flags its ranks would otherwise trip on."""
    out = [f"--routing {r}: one of uniform, skewed" for r in args.routing.split(",")
           if r and r not in ("uniform", "skewed")]
    if not getattr(args, "cluster", "") and not any(r for r in args.routing.split(",")):  # (was rc 0, no rows)
        out.append(f"--routing {args.routing!r} names no routing: give uniform, skewed or both (uniform,skewed)")
    out += _moe_lengths_problems(args)
    if not getattr(args, "cluster", "") and args.device == "cuda":  # (else torch's assertion from inside the run)
        out += _device_problems(args.device)
    if args.compile and (args.device != "cuda" or getattr(args, "cluster", "")):  # (the CPU runs ignored it)
        out.append("--compile times the compiled layer on one GPU only: give it with --device cuda and no --cluster")
    if not getattr(args, "cluster", ""):
        return out
    chunks = [c.strip() for c in args.chunks.split(",") if c.strip()]
    if not all(c.isdigit() and int(c) >= 2 for c in chunks):
        out.append(f"--chunks {args.chunks!r}: pipelined chunk counts, each an integer >= 2 (e.g. 2,4)")
    if not (args.link_scale > 0 and math.isfinite(args.link_scale)):
        out.append(f"--link-scale must be > 0, got {args.link_scale}")
    if args.slowdown != "auto":
        try:
            ok = float(args.slowdown) > 0 and math.isfinite(float(args.slowdown))
        except ValueError:
            ok = False
        if not ok:
            out.append(f"--slowdown {args.slowdown!r}: auto, or a factor > 0")
    if not (args.inter_ratio >= 0 and math.isfinite(args.inter_ratio)):
        out.append(f"--inter-ratio must be >= 0 (0 = the hardware's), got {args.inter_ratio}")
    from ..config.presets import MODEL_PRESETS

    preset = MODEL_PRESETS.get(args.model)
    if preset is None:
        out.append(f"--model {args.model}: choose among {', '.join(MODEL_PRESETS)}")
    elif not preset.get("moe.experts", 0):
        out.append(f"--model {args.model} has no MoE layers; give a MoE preset (e.g. debug-moe, small-moe)")
    elif re.fullmatch(r"\s*\d+\s*[xX]\s*\d+\s*", args.cluster):  # (a malformed one: moe_cluster.main says it)
        nodes, ranks = (int(v) for v in args.cluster.lower().split("x"))
        experts = preset["moe.experts"]
        if nodes * ranks >= 1 and experts % (nodes * ranks):  # (else every rank's reshape error, after the spawn)
            counts = [str(w) for w in range(2, experts + 1) if experts % w == 0]
            out.append(f"--cluster {args.cluster}: the {experts} experts of {args.model} are split over all "
                       f"{nodes * ranks} ranks (parallel.expert = NODES x RANKS), which must divide them; give "
                       f"NODES x RANKS of {', '.join(counts)} ranks, or another --model")
    from ..costs.hardware import ALIASES, PRESETS, hardware_names

    if ALIASES.get(args.hardware.lower(), args.hardware.lower()) not in (*PRESETS, "cpu-measured"):
        out.append(f"--hardware {args.hardware}: choose among {', '.join(hardware_names())}")
    return out


def _sharded_heads_problems(args) -> list[str]:
    """bench generate --sharded HxC: the head degree H splits the model's heads (job/checks.py check_heads), else
    every rank's ConfigError after the whole transformers comparison ran."""
    from ..job.checks import check_heads

    head = int(args.sharded.split("x")[0])
    try:
        check_heads(args.heads, args.kv_heads, head)
    except ConfigError as e:
        return [f"--sharded {args.sharded}: {str(e).rstrip('.')} (--heads {args.heads}, --kv-heads {args.kv_heads})"]
    return []


def _offload_without_blocks(args) -> list[str]:
    """bench memory's offloading policies where --skip-last keeps every block built on the device: each measured
    as the policy without offload, under its own name (training refuses the same config: inert_options.py)."""
    import torch

    from ..config.presets import MODEL_PRESETS
    from .memory import _policy

    if args.probe:  # (one --max-seq probe: its policy is the search's, checked by the command that started it)
        return []
    preset_layers = MODEL_PRESETS.get(args.preset, {}).get("layers", 0)
    gpu_search = args.max_seq and args.device != "cpu" and torch.cuda.is_available()  # (probes the whole model)
    layers = preset_layers if gpu_search else args.layers or preset_layers
    offloading = []
    for name in (x.strip() for x in args.policies.split(",") if x.strip()):
        try:
            if _policy(name)[1] > 0:
                offloading.append(name)
        except ValueError:
            pass  # (said by _policy_problems)
    if not offloading or not layers or args.skip_last < layers:
        return []
    return [f"--policies {', '.join(offloading)} would offload nothing: --skip-last {args.skip_last} keeps the last "
            f"{args.skip_last} blocks on the device, and {layers} are built; give --skip-last below {layers} or more "
            f"--layers"]


def _moe_lengths_problems(args) -> list[str]:
    """bench moe's lengths: '' skips a part (--memory-seq-len '' times only, docs/benchmarks.md), but a run whose
    every list it reads is empty (--seq-len, and on the CPU --memory-seq-len; --cluster reads neither) measured
    nothing and exited 0."""
    if getattr(args, "cluster", ""):
        return []
    read = ["seq_len"] + (["memory_seq_len"] if args.device != "cuda" else [])
    if any(str(getattr(args, name) or "").strip() for name in read):
        return []
    given = " and ".join(f"--{name.replace('_', '-')} ''" for name in read)
    return [f"{given} name{'s' if len(read) == 1 else ''} no length, so nothing is measured: give one or more "
            f"token counts, e.g. --seq-len 4096"]


def _preset_problems(preset: str) -> list[str]:
    """bench memory's --preset (refused by the model's config in the measurement, as model.preset)."""
    from ..config.presets import MODEL_PRESETS

    return [] if preset in MODEL_PRESETS else [f"--preset {preset!r}: one of {', '.join(MODEL_PRESETS)}"]


def _policy_problems(policies: str) -> list[str]:
    """bench memory's --policies, each a name its _policy reads."""
    from .memory import _policy

    out = [] if policies.strip(", ") else [f"--policies {policies!r} names no policy: give one or more, e.g. "
                                            f"none,selective"]
    for name in (x.strip() for x in policies.split(",") if x.strip()):
        try:
            _, fraction = _policy(name)
        except ValueError as e:  # (an unknown name, or offloadA whose A is no number)
            out.append(f"--policies {name}: {e}")
            continue
        if not 0 <= fraction <= 1:
            out.append(f"--policies {name}: an offload fraction is in [0, 1]")
    return out
