"""`longctx bench generate`: longctx's KV-cache decoding against transformers' greedy `generate` on
the same random model, prompt and machine, in one run (JSON on stdout, progress on stderr).

The model is a random Llama written by transformers itself (so both read the same weights; the
weights are in a temporary directory), fp32 on CPU. Both generate greedily from the same prompt and
the tokens are compared (`same_tokens`). Rates:
- longctx: generate/engine.py's own timing (prefill = the chunked prefill and the first token;
  decode = the steps after it);
- transformers: a streamer stamps the time the first new token arrives; decode = the tokens after
  it over the time from there to the end, prefill = the prompt over the time to the first token.
After an untimed first run of each, the runs alternate (--repeats of each) and the best rate of each
counts, so load from other processes on the machine (it was shared while the figures were taken)
affects both alike and rarely the best. transformers is a test dependency: this benchmark needs it installed.

Prefill memory (`prefill_memory`, also with --memory-lengths): the bytes of every tensor the
prefill creates and that is still alive, at its peak (PeakLiveBytes: a dispatch mode that sees
every op's outputs), beside the preallocated cache. Chunked prefill keeps that transient flat
(one chunk's activations) while the cache grows linearly with the prompt; an [S, S] score matrix
would be S^2 x 4 bytes per head (256 MiB at 8K).

Sharded cache memory (`--sharded HxC --sharded-lengths ...`): the same prefill on H x C spawned gloo
ranks (generate/sharded.py), each rank's cache bytes against one process's at the same length,
and each rank's prefill transient (PeakLiveBytes again): the cache is 1/(H x C) of one process's,
and the transient grows linearly with the prompt (S / (H x C) tokens per rank, never [S, S]).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import strict_json
from ..errors import ConfigError, UserError
from ..job.devices import code_record
from ..progress import phase, speaker


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn-dim", type=int, default=688)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per run")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="longctx's prefill chunk")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; the best rate counts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-lengths", default="2048,4096,8192,16384",
                   help="prompt lengths whose prefill memory is measured ('' = none)")
    p.add_argument("--sharded", default="", metavar="HxC",
                   help="also measure the prefill's memory with the cache sharded over H x C local gloo ranks "
                        "(e.g. 1x4); '' = not")
    p.add_argument("--sharded-lengths", default="8192,16384,32768", help="prompt lengths of the sharded measure")
    p.add_argument("--compile", nargs="?", const="true", default="false", choices=("false", "true", "both"),
                   help="decode through the compiled static-shape step (models/static_decode.py) on the --preset "
                        "model, no transformers: `true` compiled only, `both` eager and compiled in turn on the "
                        "same prompt (eager.*, compiled.*, decode_speedup, identical)")
    p.add_argument("--preset", default="debug", help="--compile: the model preset, random weights (default debug)")
    p.add_argument("--device", default="cpu", help="--compile: where the model decodes (cpu, or cuda: the step "
                                                    "captured as CUDA graphs)")


class PeakLiveBytes(TorchDispatchMode):
    """The peak over a computation of the bytes held by tensors it created (op outputs that are
    new storages), and the largest one. Storages only this tracker still holds are released before
    each op, so a freed temporary counts no longer than it lives (its memory may be reused)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, torch.UntypedStorage] = {}
        self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.live = {p: st for p, st in self.live.items() if torch._C._storage_Use_Count(st._cdata) > 1}
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in inputs and ptr not in self.live:
                    self.live[ptr] = st
                    self.largest = max(self.largest, st.nbytes())
        self.peak = max(self.peak, sum(st.nbytes() for st in self.live.values()))
        return out


def prefill_memory(model, length: int, chunk: int, seed: int = 0) -> dict:
    """Prefill one random prompt of `length` tokens in chunks of `chunk`: the cache's bytes and the
    peak bytes of the tensors the prefill itself created (and the largest of them)."""
    from ..generate.local import prefill
    from ..models.kv_cache import KVCache

    tokens = torch.randint(0, model.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        cache = KVCache.for_model(model, 1, length)
        tracker = PeakLiveBytes()
        with tracker:
            prefill(model, cache, tokens, chunk)
    return {"prompt_tokens": length, "chunk": chunk, "cache_bytes": cache.nbytes,
            "peak_transient_bytes": tracker.peak, "largest_tensor_bytes": tracker.largest}


def _sharded_prefill_rank(model, length: int, head: int, ctx: int, seed: int) -> dict:
    """On each spawned rank: prefill one random prompt into the sharded cache; its bytes and the
    prefill's own peak here, and the last token's argmax (the same on every rank)."""
    from ..config import load_config
    from ..generate.sharded import ShardedGeneration
    from ..job.runtime import Runtime

    cfg = load_config(overrides=[f"--parallel.head={head}", f"--parallel.ctx={ctx}"])
    rt = Runtime.create(cfg, torch.distributed.get_rank(), head * ctx, "cpu")
    backend = ShardedGeneration(rt.mesh, rt.world_mesh)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        cache = backend.cache(model, 1, length)
        tracker = PeakLiveBytes()
        with tracker:
            logits = backend.prefill(model, cache, tokens, 0)
    return {"cache_bytes": cache.nbytes, "peak_transient_bytes": tracker.peak,
            "largest_tensor_bytes": tracker.largest, "argmax": int(logits.argmax())}


def sharded_memory(model, layout: str, lengths: list[int], seed: int = 0) -> list[dict]:
    """Per length: one process's cache bytes, and over the ranks of the `HxC` layout the largest
    cache share, its ratio, the largest prefill transient; the ranks' argmax agree."""
    from ..job.spawn import run_spawned_many
    from ..models.kv_cache import KVCache

    head, ctx = (int(x) for x in layout.lower().split("x"))
    jobs = [(length, _sharded_prefill_rank, (model, length, head, ctx, seed)) for length in lengths]
    per_rank = run_spawned_many(head * ctx, jobs)
    out = []
    for length in lengths:
        ranks = per_rank[length]
        one = KVCache.for_model(model, 1, length, device="meta").nbytes
        share = max(r["cache_bytes"] for r in ranks)
        out.append({"prompt_tokens": length, "head": head, "ctx": ctx, "one_process_cache_bytes": one,
                    "rank_cache_bytes": share, "cache_ratio": share / one,
                    "rank_peak_transient_bytes": max(r["peak_transient_bytes"] for r in ranks),
                    "rank_largest_tensor_bytes": max(r["largest_tensor_bytes"] for r in ranks),
                    "ranks_agree": len({r["argmax"] for r in ranks}) == 1})
        say(f"sharded {layout} at {length:,} tokens: cache per rank {share / 2**20:.1f} MiB "
                  f"({share / one:.3f}x one process's), prefill transient per rank "
                  f"{out[-1]['rank_peak_transient_bytes'] / 2**20:.1f} MiB")
    return out


say = speaker("[bench generate] ")


def _time_decode(model, prompt: list[int], new_tokens: int, chunk: int, compile) -> dict:
    from ..generate.engine import generate

    r = generate(model, [prompt], max_new_tokens=new_tokens, prefill_chunk=chunk, compile=compile)[0]
    return {"tokens": r.tokens, "prefill_tokens_per_s": r.prefill_tokens_per_s,
            "decode_tokens_per_s": r.decode_tokens_per_s}


def measure_compile(args) -> dict:
    """`--compile true|both`: the --preset model (random weights, seed --seed) decodes one random prompt
    greedily, eagerly and through the compiled step (one CompiledStep, compiled by an untimed first
    run; eager decoding has an untimed first run too), in turn --repeats times; the best rate of each
    counts (median beside it)."""
    from torch._dynamo.utils import counters

    from ..config import load_config
    from ..models.llama import build_model
    from ..models.static_decode import CompiledStep

    cfg = load_config(overrides=[f"--model.preset={args.preset}"]).model
    model = build_model(cfg, seed=args.seed).to(args.device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed))
    prompt = prompt.tolist()
    step = CompiledStep()
    t0 = time.perf_counter()
    _time_decode(model, prompt, args.new_tokens, args.prefill_chunk, step)  # compiles (or loads) the graph
    compile_s = time.perf_counter() - t0
    graphs_compiled = counters["stats"]["unique_graphs"]
    say(f"{args.preset} model, {args.prompt_len}-token prompt: compiled in {compile_s:.1f} s")
    modes = {"eager": False, "compiled": step} if args.compile == "both" else {"compiled": step}
    if "eager" in modes:  # its own untimed first run, as the compiled step had (else its first-call costs,
        _time_decode(model, prompt, args.new_tokens, args.prefill_chunk, False)  # timed, lean the speedup)
    runs = {name: [] for name in modes}
    for i in range(args.repeats):
        for name, compile in modes.items():
            runs[name].append(_time_decode(model, prompt, args.new_tokens, args.prefill_chunk, compile))
        say(f"run {i + 1}/{args.repeats}: decode tokens/s " +
            ", ".join(f"{name} {v[-1]['decode_tokens_per_s']:.1f}" for name, v in runs.items()))
    result = {
        "benchmark": "generate", "compile": args.compile, "date": date.today().isoformat(),
        "machine": platform.machine(), "device": args.device, "card": card_name(args.device),
        "torch": torch.__version__, "code": code_record(), "threads": torch.get_num_threads(),
        "model": {"preset": args.preset, "dim": cfg.dim, "layers": cfg.layers, "heads": cfg.heads,
                  "kv_heads": cfg.kv_heads, "ffn_dim": cfg.ffn_dim, "vocab": cfg.vocab_size, "dtype": "float32"},
        "batch": 1, "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "compile_seconds": compile_s, "compiled_calls": step.calls,
        # what would put per-token work back outside the graph: a compilation inside the timed runs, a graph
        # break, a graph inductor ran without CUDA graphs (`cudagraph_skips`; TORCH_LOGS=perf_hints says why)
        "graphs_compiled_in_timed_runs": counters["stats"]["unique_graphs"] - graphs_compiled,
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }
    for name, v in runs.items():
        rates = [r["decode_tokens_per_s"] for r in v]
        result[name] = {"decode_tokens_per_s": max(rates), "decode_tokens_per_s_median": statistics.median(rates),
                        "prefill_tokens_per_s": max(r["prefill_tokens_per_s"] for r in v), "runs": rates}
    if "eager" in runs:
        result["decode_speedup"] = result["compiled"]["decode_tokens_per_s"] / result["eager"]["decode_tokens_per_s"]
        result["decode_speedup_median"] = (result["compiled"]["decode_tokens_per_s_median"]
                                           / result["eager"]["decode_tokens_per_s_median"])
        result["identical"] = all(a["tokens"] == b["tokens"] for a, b in zip(runs["eager"], runs["compiled"]))
    return result


def card_name(device: str) -> str:
    """The card a --device cuda run decoded on (its JSON names it, as every GPU result does), else the CPU."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def _random_hf_model(args, directory: Path):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn_dim,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                                   max_position_embeddings=max(4096, args.prompt_len + args.new_tokens),
                                   tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(directory)
    model.generation_config.eos_token_id = None  # every run makes exactly --new-tokens tokens
    return model


def _time_transformers(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # the prompt first, then each new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    stamps = Stamps()
    t0 = time.perf_counter()
    with torch.inference_mode():
        # the mask given: without it transformers infers one that hides every prompt token equal to
        # pad_token_id (0), so a prompt holding a 0 was decoded from another context (same_tokens false)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=stamps)
    t_end = time.perf_counter()
    first = stamps.times[1]
    tokens = out[0, prompt.shape[1]:].tolist()
    return {"tokens": tokens, "prefill_tokens_per_s": prompt.shape[1] / (first - t0),
            "decode_tokens_per_s": (len(tokens) - 1) / (t_end - first), "seconds": t_end - t0}


def _time_longctx(model, prompt: torch.Tensor, new_tokens: int, chunk: int) -> dict:
    from ..generate.engine import generate

    t0 = time.perf_counter()
    r = generate(model, [prompt[0].tolist()], max_new_tokens=new_tokens, prefill_chunk=chunk)[0]
    return {"tokens": r.tokens, "prefill_tokens_per_s": r.prefill_tokens_per_s,
            "decode_tokens_per_s": r.decode_tokens_per_s, "seconds": time.perf_counter() - t0}


def main(args) -> int:
    if args.repeats < 1:  # (0 timed runs: no figure, only an empty minimum or an infinite time)
        raise ConfigError(f"--repeats {args.repeats}: time at least one run (e.g. --repeats 3).")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile != "false":
        with phase("bench generate --compile"):
            result = measure_compile(args)
        print(strict_json.dumps(result, indent=1))
        return 0
    try:
        import transformers
    except ImportError:
        raise UserError("longctx bench generate compares against transformers; pip install transformers.") from None
    # each case a progress phase: one that takes long is said while it runs
    with phase("bench generate"):
        result = _measure(args, transformers)
    print(strict_json.dumps(result, indent=1))
    return 0


def _measure(args, transformers) -> dict:
    """The document `longctx bench generate` prints."""
    from ..models.hf import load_hf

    with tempfile.TemporaryDirectory() as tmp:
        say(f"random Llama dim {args.dim}, {args.layers} layers, vocab {args.vocab} (written by transformers)")
        theirs = _random_hf_model(args, Path(tmp))
        ours = load_hf(tmp).eval()
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    # an untimed first run of each, as --compile's modes have: the first run paid the first-call costs (the
    # kernels' set-up, the allocator's growth) in its rates, longctx's more than transformers' that came after it
    with phase("untimed first run of each (longctx, transformers)", done_line=False):
        _time_longctx(ours, prompt, args.new_tokens, args.prefill_chunk)
        _time_transformers(theirs, prompt, args.new_tokens)
    runs = {"longctx": [], "transformers": []}
    for i in range(args.repeats):
        with phase(f"run {i + 1}/{args.repeats} (longctx, then transformers)", done_line=False):
            runs["longctx"].append(_time_longctx(ours, prompt, args.new_tokens, args.prefill_chunk))
            runs["transformers"].append(_time_transformers(theirs, prompt, args.new_tokens))
        say(f"run {i + 1}/{args.repeats}: decode tokens/s longctx "
                  f"{runs['longctx'][-1]['decode_tokens_per_s']:.1f}, transformers "
                  f"{runs['transformers'][-1]['decode_tokens_per_s']:.1f}")
    memory = []
    for length in (int(x) for x in args.memory_lengths.split(",") if x):
        with phase(f"prefill memory at {length:,} tokens", done_line=False):
            memory.append(prefill_memory(ours, length, args.prefill_chunk, args.seed))
        say(f"prefill memory at {length:,} tokens: cache {memory[-1]['cache_bytes'] / 2**20:.1f} MiB, peak "
                  f"transient {memory[-1]['peak_transient_bytes'] / 2**20:.1f} MiB")
    sharded = []
    if args.sharded:
        with phase(f"sharded prefill memory ({args.sharded})", done_line=False):
            sharded = sharded_memory(ours, args.sharded, [int(x) for x in args.sharded_lengths.split(",") if x],
                                     args.seed)
    best = {k: {m: max(r[m] for r in v) for m in ("prefill_tokens_per_s", "decode_tokens_per_s")}
            for k, v in runs.items()}
    median = {k: statistics.median(r["decode_tokens_per_s"] for r in v) for k, v in runs.items()}
    result = {
        "benchmark": "generate", "date": date.today().isoformat(), "machine": platform.machine(),
        "torch": torch.__version__, "transformers_version": transformers.__version__, "code": code_record(),
        "threads": torch.get_num_threads(),
        "model": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "ffn_dim": args.ffn_dim, "vocab": args.vocab, "dtype": "float32"},
        "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens, "prefill_chunk": args.prefill_chunk,
        "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(runs["longctx"], runs["transformers"])),
        "longctx": best["longctx"], "transformers": best["transformers"],
        "decode_ratio": best["longctx"]["decode_tokens_per_s"] / best["transformers"]["decode_tokens_per_s"],
        "prefill_ratio": best["longctx"]["prefill_tokens_per_s"] / best["transformers"]["prefill_tokens_per_s"],
        "decode_ratio_median": median["longctx"] / median["transformers"],
        "prefill_memory": memory,
        "sharded_memory": sharded,
        "runs": {k: [{m: r[m] for m in ("prefill_tokens_per_s", "decode_tokens_per_s", "seconds")} for r in v]
                 for k, v in runs.items()},
    }
    return result
