"""`longctx bench memory`: activation bytes per block and per token for each memory policy,
measured (memory/measured.py's storage tracker) against the analytic count, with recomputed
FLOPs, same-run step-time ratios to `none`, and on a GPU the allocator's peak and (--max-seq) the
longest sequence that trains.

Per-block bytes do not depend on how many blocks the model has, so `--layers` (default 3: one or
more offloaded blocks plus the kept last one) keeps long sequences of big shapes measurable on a
small machine. Output: one JSON document on stdout; progress (a line as each policy, timing round
and --max-seq probe starts and ends, with seconds; while the timing runs, heartbeat lines counting its steps)
goes to stderr, so a run of minutes is never silent.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

from .. import strict_json
from ..config import MemoryConfig, build_model_config, load_config
from ..data.samples import IGNORE, Batch
from ..errors import ConfigError
from ..job.devices import code_record
from ..job.dims import ParallelDims
from ..job.spawn import run_spawned
from ..memory.accounting import estimate_activations, layer_activations, published_formulas
from ..memory.measured import measure_activations
from ..memory.policy import MemoryPolicy
from ..memory.rss import peak_rss_bytes
from ..models.llama import build_model
from ..parallel.context.sequence import shard_sequence
from ..parallel.parallelize import apply_memory, use_sequence_parallel_attention
from ..progress import Phase, phase, speaker
from ..step.loss import router_loss, training_loss
from .max_seq import HOST_OOM, check_search, is_host_oom, longest_sequence, longest_sequence_cpu, parse_bytes

POLICIES = {
    "none": ("none", 0.0),
    "full": ("full", 0.0),
    "selective": ("selective", 0.0),
    "offload0.5": ("selective", 0.5),
    "offload1.0": ("selective", 1.0),
}
DEFAULT_SEQ_LEN = "8192"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="debug", help="model shape (config.py presets)")
    p.add_argument("--layers", type=int, default=3, help="blocks to build (0 = the preset's); per-block bytes "
                                                          "do not depend on it")
    # (None when left out: --max-seq then measures no per-length table, and one given is measured whatever it is)
    p.add_argument("--seq-len", default=None, help=f"comma-separated sequence lengths (tokens; default "
                                                   f"{DEFAULT_SEQ_LEN}, none with --max-seq)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {list(POLICIES)}, "
                                                                   f"offloadA (selective) or fulloffloadA (full) "
                                                                   f"for any fraction A")
    p.add_argument("--skip-last", type=int, default=1, help="memory.offload_skip_last")
    p.add_argument("--head", type=int, default=1, help="head-parallel degree (spawns head x ctx gloo ranks)")
    p.add_argument("--ctx", type=int, default=1, help="context-parallel degree")
    p.add_argument("--docs", type=int, default=1, help="documents packed in each sequence (document masks)")
    p.add_argument("--loss-chunk", type=int, default=4096, help="memory.loss_chunk")
    p.add_argument("--block-chunk", type=int, default=0, help="memory.block_chunk (applied to full and selective)")
    p.add_argument("--time-steps", type=int, default=2, help="forward+backward steps timed per policy (0: none)")
    p.add_argument("--no-backward", action="store_true", help="measure after the forward only (long sequences)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--attention-chunk", type=int, default=0, help="memory.attention_chunk (applied to every "
                                                                    "policy)")
    p.add_argument("--attention-offload", action="store_true", help="memory.attention_offload")
    p.add_argument("--max-seq", action="store_true",
                   help="binary-search the longest sequence whose training step fits, for each policy: on a "
                        "GPU the allocator's limit (full model), on CPU the peak RSS of one step in a fresh "
                        "process under --budget (the --layers model)")
    p.add_argument("--budget", default="", help="CPU --max-seq: peak RSS budget of the whole step process, "
                                                "e.g. 6GiB or 512MiB")
    p.add_argument("--doc-len", type=int, default=0,
                   help="--max-seq: documents of this many tokens (attention work linear in the length, so long "
                        "CPU probes finish); 0 = --docs documents per sequence")
    p.add_argument("--max-seq-step", type=int, default=4096, help="--max-seq resolution in tokens")
    p.add_argument("--max-seq-hi", type=int, default=1 << 22, help="GPU --max-seq: the longest length probed")
    p.add_argument("--malloc-mmap-threshold", type=int, default=131072,
                   help="CPU --max-seq: glibc's MALLOC_MMAP_THRESHOLD_ for the probe processes, so freed "
                        "tensors leave the RSS (glibc's default grows the threshold and keeps up to ~2x the live "
                        "bytes mapped); 0 = glibc's default")
    p.add_argument("--out", default="", help="also write the JSON here")
    p.add_argument("--probe", default="", help=argparse.SUPPRESS)


say = speaker("bench memory ", clock=True)  # (the seconds since the command started)


def seq_lengths(args) -> str:
    """--seq-len as given, else its default: 8192, or none under --max-seq (the per-length tables are not what
    the search asks for). A length given is measured, the default's value too: told apart by its value, an
    explicit --seq-len 8192 beside --max-seq was dropped from the JSON unsaid."""
    if args.seq_len is not None:
        return args.seq_len
    return "" if args.max_seq else DEFAULT_SEQ_LEN


def _policy(name: str) -> tuple[str, float]:
    if name in POLICIES:
        return POLICIES[name]
    for prefix, policy in (("fulloffload", "full"), ("offload", "selective")):
        if name.startswith(prefix):
            try:
                return policy, float(name.removeprefix(prefix))
            except ValueError:  # (float's own message named neither the policy nor what A is)
                raise ValueError(f"{prefix}A takes A, the fraction of the blocks offloaded, as a number in "
                                 f"[0, 1] (e.g. {prefix}0.25)") from None
    raise ValueError(f"unknown policy '{name}'; use one of {list(POLICIES)}, offloadA or fulloffloadA "
                     f"(e.g. offload0.25)")


def _batch(vocab: int, seq: int, batch: int, docs: int, device, doc_len: int = 0):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    if doc_len:
        docs = -(-seq // doc_len)
        bounds = torch.arange(doc_len, seq, doc_len)
    else:
        bounds = torch.linspace(0, seq, docs + 1).long()[1:-1]
    doc = torch.bucketize(torch.arange(seq), bounds, right=True).expand(batch, seq).contiguous()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), bounds])
    positions = torch.arange(seq).expand(batch, seq) - starts[doc]
    return [tokens.to(device), positions.to(device), doc.to(device) if docs > 1 else None, labels.to(device)]


def _model_cfg(args, layers: int | None = None):
    """The preset's shape (its [model.moe] keys included) with --layers blocks (0 = the preset's)."""
    layers = args.layers if layers is None else layers
    return build_model_config({"preset": args.preset, **({"layers": layers} if layers else {})})


def _build(model_cfg, policy: str, fraction: float, args, dims, mesh, device):
    model = build_model(model_cfg, device=device, seed=0)
    if dims is not None:
        use_sequence_parallel_attention(model, dims, mesh)
    chunk = args.block_chunk if policy != "none" else 0
    apply_memory(model, MemoryConfig(recompute=policy, offload_fraction=fraction, offload_skip_last=args.skip_last,
                                     loss_chunk=args.loss_chunk, block_chunk=chunk,
                                     attention_chunk=args.attention_chunk,
                                     attention_offload=args.attention_offload and bool(args.attention_chunk)),
                 device.type)
    return model


def _block_errors(measured: dict, est: dict, layers: list) -> dict:
    """Largest relative error over blocks between measured and analytic bytes (device, host), each
    block against its own count (memory.accounting.layer_activations: a MoE model's dense and MoE
    blocks differ; the last offloaded block's output, kept on the device, is its own)."""
    worst = {"device": 0.0, "host": 0.0}
    for b, layer in zip(measured["blocks"], layers):
        expect = {"device": layer.device, "host": layer.host}
        for k in worst:
            if expect[k] or b[k]:
                worst[k] = max(worst[k], abs(b[k] - expect[k]) / max(expect[k], 1.0))
    worst["total_device"] = abs(measured["total_device"] - est["total_device"]) / est["total_device"]
    return worst


def step_loss(model, inputs, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What a training step backwards for these inputs as its one micro-batch (step/loss.py training_loss): the mean
    loss over their labels and an MoE model's router terms. (With the LM loss alone, an MoE model's step was not
    training's: neither the routers' balancing gradients nor their backward, which frees the router records.)
    The router terms' scale is one process's: a gradient's size is no part of a memory or time figure."""
    tokens, positions, doc, labels = inputs
    weight = 1 / (labels != IGNORE).sum().clamp(min=1)  # (on the device: no wait inside a timed step)
    return training_loss(model, Batch(tokens, labels, positions, doc), autocast_dtype, weight, 1, 1.0)[0]


def _one_step(model, inputs, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step_loss(model, inputs).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _time_interleaved(models: dict, inputs, steps: int, device, progress: Phase | None = None) -> dict:
    """Median step time per policy, the policies taking turns step by step (one warm-up step each),
    so drifting machine load hits them alike. Each step, warm-up or timed, counts one on `progress`."""
    times = {name: [] for name in models}
    for model in models.values():
        _one_step(model, inputs, device)
        _counted(progress)
    for _ in range(steps):
        for name, model in models.items():
            times[name].append(_one_step(model, inputs, device))
            _counted(progress)
    return {name: statistics.median(t) for name, t in times.items()}


def _counted(progress: Phase | None) -> None:  # (outside the step's clock: the count is no part of its time)
    if progress is not None:
        progress.update()


def measure(args, seq: int, dims=None, mesh=None) -> dict:
    """Every requested policy at one sequence length, on this process (one rank of head x ctx)."""
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    model_cfg = _model_cfg(args)
    inputs = _batch(model_cfg.vocab_size, seq, args.micro_batch, args.docs, device)
    if mesh is not None:
        inputs = [None if t is None else shard_sequence(t, mesh) for t in inputs]
    head, ctx = (dims.head, dims.ctx) if dims is not None else (1, 1)
    speak = say if mesh is None or mesh.get_rank() == 0 else (lambda _text: None)  # one rank speaks
    where = f"seq_len {seq:,}" + (f" (head {head} x ctx {ctx} ranks)" if mesh is not None else "")
    out, models = {}, {}
    for name in args.policies.split(","):
        policy, fraction = _policy(name)
        speak(f"{where}, {name}: measuring activations")
        t0 = time.perf_counter()
        try:
            model = _build(model_cfg, policy, fraction, args, dims, mesh, device)
            out[name] = _measure_policy(model, model_cfg, policy, fraction, args, seq, (head, ctx), inputs, device,
                                        held=sum(_model_bytes(m) for m in models.values()))
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:  # (a policy that does not fit: its answer)
            model = None  # (its blocks freed before _out_of_memory empties the cache)
            out[name] = {"policy": policy, "offload_fraction": fraction, "fits": False,
                         "error": _out_of_memory(e, device)}
            speak(f"{where}, {name}: {out[name]['error']}")
            continue
        speak(f"{where}, {name}: measured in {time.perf_counter() - t0:.1f} s")
        if args.time_steps > 0:
            models[name] = model
        del model
    if models:
        speak(f"{where}: timing {args.time_steps} step{'s' if args.time_steps != 1 else ''} of each of "
              f"{len(models)} policies (taking turns, after a warm-up step each)")
        t0 = time.perf_counter()
        try:  # (counted by steps, the warm-ups too: a long length's timing says how far it is, and the time left)
            with phase(f"timing {len(models)} policies", total=len(models) * (args.time_steps + 1), unit="steps",
                       done_line=False) as timing:
                _add_step_times(out, models, inputs, args.time_steps, device, timing)
            speak(f"{where}: timed in {time.perf_counter() - t0:.1f} s")
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:  # (every timed model held at once)
            said = _out_of_memory(e, device)
            for name in models:
                out[name]["step_time_error"] = f"{said} (the {len(models)} timed policies' models held together)"
            speak(f"{where}: no step times: {said}")
    # the rank's tokens: the same under every policy (None where none was measured: each ran out of memory)
    tokens = next((e["analytic"]["tokens"] for e in out.values() if "analytic" in e), None)
    return {"seq_len": seq, "tokens_per_rank": tokens, "model": model_cfg.preset, "layers_built": model_cfg.layers,
            "published_per_layer_16bit": published_formulas(model_cfg, seq, args.micro_batch, head * ctx),
            "policies": out}


def _out_of_memory(e: BaseException, device) -> str:
    """What a measurement that ran out of memory (the GPU's, or the host's: bench/max_seq.py is_host_oom) says, an
    answer as --max-seq's probes take it: the other policies and lengths keep their figures (an OOM of `none` at a
    long length lost the whole table). Any other error is raised."""
    if not (isinstance(e, torch.OutOfMemoryError) or is_host_oom(e)):
        raise e
    if device.type == "cuda":
        torch.cuda.empty_cache()  # (the failed policy's blocks: not the next one's to fit beside)
    kind = "GPU out of memory" if isinstance(e, torch.OutOfMemoryError) else HOST_OOM
    return f"{kind}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _model_bytes(model) -> int:
    """Bytes of a model's parameters, buffers and gradients (distinct storages)."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _measure_policy(model, model_cfg, policy: str, fraction: float, args, seq: int, layout: tuple[int, int],
                    inputs, device, held: int = 0) -> dict:
    """One policy's measured activation bytes beside the analytic count (and on a GPU its step's peak:
    the allocator's peak less `held`, the bytes of the other policies' models kept alive for the
    timing, which are on the same device but not this policy's)."""
    head, ctx = layout
    measured = measure_activations(model, *inputs[:3], labels=inputs[3], backward=not args.no_backward,
                                   extra_loss=lambda m: router_loss(m, 1, 1.0)[0])  # (as step_loss's)
    # the policy the model was built with (_build), the attention chunks and their offload included
    analytic_policy = MemoryPolicy(policy, fraction, args.skip_last, loss_chunk=args.loss_chunk,
                                   block_chunk=args.block_chunk if policy != "none" else 0,
                                   attention_chunk=args.attention_chunk,
                                   attention_offload=args.attention_offload and bool(args.attention_chunk))
    est = estimate_activations(model_cfg, seq, args.micro_batch, head=head, ctx=ctx, policy=analytic_policy,
                               dtype_bytes=4, docs=args.docs > 1).to_dict()
    layers = layer_activations(model_cfg, seq, args.micro_batch, head=head, ctx=ctx, policy=analytic_policy,
                               dtype_bytes=4, docs=args.docs > 1)
    tokens = est["tokens"]
    entry = {
        "policy": policy, "offload_fraction": fraction,
        "measured_blocks_bytes_per_token": [{k: v / tokens for k, v in b.items()} for b in measured["blocks"]],
        "measured_total_device_bytes": measured["total_device"],
        "measured_total_host_bytes": measured["total_host"],
        "analytic": est,
        "analytic_per_token": {k: est[k] / tokens for k in ("per_block_device", "per_block_host",
                                                            "kept_block_device")},
        "analytic_blocks_bytes_per_token": [{"device": la.device / tokens, "host": la.host / tokens,
                                             **({"moe": True} if la.moe else {})} for la in layers],
        "max_relative_error": _block_errors(measured, est, layers),
        "recompute_flops_per_token": est["recompute_flops"] / tokens,
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _one_step(model, inputs, device)
        entry["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - held
    return entry


def _add_step_times(out: dict, models: dict, inputs, steps: int, device, progress: Phase | None = None) -> None:
    """Each timed policy's median step time into its entry, and its ratio to `none` when `none` was timed."""
    for name, step_s in _time_interleaved(models, inputs, steps, device, progress).items():
        out[name]["step_s"] = step_s
    base = out.get("none", {}).get("step_s")
    for entry in out.values():
        if base and "step_s" in entry:  # (a policy that did not fit was not timed)
            entry["step_time_ratio_to_none"] = entry["step_s"] / base


def _probe_step(args, policy: str, fraction: float, seq: int) -> dict:
    """One training step of the --layers model at `seq` tokens (--micro-batch sequences of them) in this
    process: peak RSS (whole process) and time; on CUDA (bf16 weights, autocast) also the allocator's peak, and an
    out-of-memory error is an answer ("fits": false), not a failure. Run in a fresh process per
    probe (`--probe`), so that neither the GPU's nor the host's memory carries over, and a probe the
    host kills (pinned memory of an offload policy) costs the probe, not the search."""
    model_cfg = _model_cfg(args)
    cuda = args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    try:
        model = _build(model_cfg, policy, fraction, args, None, None, device)
        if cuda:  # (the cast rounds the RoPE frequencies too: back to fp32, as generation's cast does)
            model = model.to(torch.bfloat16)
            model.init_rope()
        inputs = _batch(model_cfg.vocab_size, seq, args.micro_batch, args.docs, device, args.doc_len)
        t0 = time.perf_counter()
        step_loss(model, inputs, torch.bfloat16 if cuda else None).backward()  # (training's autocast on CUDA)
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        if not cuda:
            raise
        return {"seq_len": seq, "fits": False, "error": "GPU out of memory", "peak_rss_bytes": peak_rss_bytes()}
    except (MemoryError, RuntimeError) as e:  # the host's allocator refused (plain or pinned memory)
        if not is_host_oom(e):
            raise
        return {"seq_len": seq, "fits": False, "error": f"{HOST_OOM}: {type(e).__name__}: {str(e)[:200]}",
                "host_memory": True, "peak_rss_bytes": peak_rss_bytes()}
    out = {"seq_len": seq, "peak_rss_bytes": peak_rss_bytes(), "step_s": time.perf_counter() - t0}
    if cuda:
        out.update(fits=True, peak_allocated_bytes=torch.cuda.max_memory_allocated())
    return out


def _rank_measure(args, seq):
    cfg = load_config(overrides=[f"--parallel.head={args.head}", f"--parallel.ctx={args.ctx}"])
    dims = ParallelDims.from_config(cfg, world_size=dist.get_world_size())
    return measure(args, seq, dims, dims.build_mesh("cpu"))


def main(args) -> int:
    if args.probe:  # one --max-seq probe, in its own process
        name, seq = args.probe.rsplit(":", 1)
        print(strict_json.dumps(_probe_step(args, *_policy(name), int(seq))))
        return 0
    from ..durable import check_output_path

    check_output_path("--out", args.out, {})  # (before the measurement: it is written once that has run)
    # the names as arg_checks read them ("none, full": spaces around the commas)
    args.policies = ",".join(x.strip() for x in args.policies.split(",") if x.strip())
    # each case a progress phase: one that takes long is said while it runs
    with phase("bench memory"):
        doc = _measure_all(args)
    text = strict_json.dumps(doc, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def _measure_all(args) -> dict:
    """The document `longctx bench memory` prints: per length, and with --max-seq the longest sequences."""
    if args.max_seq:
        on_gpu = torch.cuda.is_available() and args.device != "cpu"
        if not on_gpu and not args.budget:
            raise ConfigError("--max-seq on CPU needs --budget BYTES (e.g. --budget 6GiB): "
                              "the peak RSS a step may reach.")
        try:  # a bad size or policy fails here, before any probe
            if not on_gpu:
                parse_bytes(args.budget)
            check_search(args, on_gpu)
            for name in args.policies.split(","):
                _policy(name)
        except ValueError as err:
            raise ConfigError(f"{str(err).rstrip('.')}.") from None
    results = []
    for seq in (int(s) for s in seq_lengths(args).split(",") if s):
        world = args.head * args.ctx
        if world > 1:
            say(f"seq_len {seq:,}: starting {world} gloo ranks (head {args.head} x ctx {args.ctx})")
            with phase(f"seq_len {seq:,} on {world} ranks", done_line=False):
                per_rank = run_spawned(world, _rank_measure, args, seq)
            result = per_rank[0]
            result["ranks"] = world
            result["max_relative_error_over_ranks"] = {
                name: {k: max(r["policies"][name]["max_relative_error"][k] for r in per_rank)
                       for k in per_rank[0]["policies"][name]["max_relative_error"]}
                for name in result["policies"] if all("max_relative_error" in r["policies"][name] for r in per_rank)}
        else:
            with phase(f"seq_len {seq:,}", done_line=False):
                result = measure(args, seq)
        results.append(result)
    doc = {
        "bench": "memory", "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "code": code_record(),
        "device": "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu",
        "preset": args.preset, "micro_batch": args.micro_batch, "layout": {"head": args.head, "ctx": args.ctx},
        "skip_last": args.skip_last, "docs": args.docs, "results": results,
    }
    if args.max_seq:
        if torch.cuda.is_available() and args.device != "cpu":
            doc["longest_sequence"] = {}
            for name in args.policies.split(","):
                with phase(f"longest sequence of {name}", done_line=False):
                    doc["longest_sequence"][name] = longest_sequence(args, name)
        else:
            budget = parse_bytes(args.budget)
            doc["longest_sequence"] = {
                "budget_bytes": budget, "measure": "peak RSS of one training step in a fresh process",
                "malloc_mmap_threshold": args.malloc_mmap_threshold or "glibc default",
                "per_policy": {}}
            for name in args.policies.split(","):
                with phase(f"longest sequence of {name} within {budget / 2**30:.1f} GiB", done_line=False):
                    doc["longest_sequence"]["per_policy"][name] = longest_sequence_cpu(args, name, budget)
    return doc
