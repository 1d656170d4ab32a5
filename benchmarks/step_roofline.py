"""A roofline audit of one training step (issue 52): every aten op of one forward + backward + AdamW step,
with its dtypes and shapes, and its time on a GPU estimated by a roofline, for `longctx train`'s model
(recompute full, chunked loss, bf16 autocast over fp32 weights, fused AdamW) and for the peer of
benchmarks/peer_train.py (transformers' LlamaForCausalLM, SDPA, gradient checkpointing). Runs on CPU.

    python benchmarks/step_roofline.py --preset llama3-1b --tokens 1024,2048 --target 8192 --out X.json

Why a roofline on CPU: the H200 run measured longctx at 0.69x the peer's tokens/s at 8K and at 32K alike,
which points at per-token costs (GEMMs in the wrong dtype, casts, extra elementwise passes) more than at
attention; those are visible in the op stream whatever the device. Each op costs
max(FLOPs / peak, bytes / bandwidth): matmuls and attention kernels at the bf16 dense peak (or the fp32
peak, TF32 off), everything else at the memory bandwidth over the bytes it reads and writes; views
cost nothing. Kernel launches are counted, not timed.

The model has the preset's width and vocabulary with 1 and 2 layers, each at two token counts; per op
signature (name, input dtypes, output dtype, class) the time is fitted as a + b x tokens (per step and per
token parts) and extrapolated to the preset's layers (one-layer run + (layers - 1) x the difference) and to
`--target` tokens. Attention kernels scale with tokens squared (causal, one document per row): their
per-token time is scaled by target / tokens instead. The chunked loss runs at tokens / (target / loss_chunk)
per chunk so it has as many chunks as at the target.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BF16_FLOPS = 790e12  # H200 dense bf16
FP32_FLOPS = 67e12  # H200 fp32 without TF32
BANDWIDTH = 4.8e12  # H200 HBM3e bytes/s

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addmv", "mv", "dot"}
ATTENTION_FORWARD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_flash_attention_forward",
                     "_scaled_dot_product_cudnn_attention"}
ATTENTION_BACKWARD = {name + "_backward" for name in ATTENTION_FORWARD}
ROW_READS = {"embedding", "index_select", "gather"}  # read the rows they return, not their whole input
ROW_WRITES = {"index_copy_"}  # write the rows they are given in place, without reading the destination
# ops that wait for the device on a GPU (the host reads a value): counted, not timed
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim"}
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        "lift_fresh", "detach", "alias", "set_", "resize_", "_has_compatible_shallow_copy_type",
        "is_same_size", "_unsafe_view", "view", "_reshape_alias"}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """The bytes a kernel reads or writes of `t`: an expanded view (stride 0, the gradient of a sum or a
    broadcast) holds its values once, and a GPU kernel reads them once from memory, the repeats from cache."""
    held = math.prod(n for n, stride in zip(t.shape, t.stride()) if stride != 0) if t.numel() else 0
    return held * t.element_size()


def _is_view(func) -> bool:
    """An op whose every return aliases an input without writing it (view, transpose, expand...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _written_in_place(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (its `a!` arguments: add_, copy_, out=, the fused AdamW's lists)."""
    written = []
    for arg, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                 func._schema.arguments[len(args):]]):
        if arg.alias_info is not None and arg.alias_info.is_write and value is not None:
            written += _tensors(value)
    return written


def _attention_flops(name: str, args) -> float:
    """4 b h sq sk d for a forward (x 1/2 causal), 2.5 times that for a backward (its 5 matmuls to 2)."""
    backward = name.endswith("_backward")
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    b, h, sq, d = q.shape
    sk = k.shape[2]
    causal = any(a is True for a in args[3:]) if not backward else any(a is True for a in args[5:])
    flops = 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)
    return flops * (2.5 if backward else 1.0)


@dataclass
class Op:
    name: str
    kind: str
    in_dtypes: str
    out_dtype: str
    flops: float
    bytes: float
    seconds: float


def classify(func, args, kwargs, out, params: set[int]) -> Op | None:
    """The op's class and roofline time; None for ops that move no data (views, empty, metadata)."""
    name = func.__name__.split(".")[0]
    if name in FREE or _is_view(func):
        return None
    ins, outs = _tensors((args, kwargs)), _tensors(out)
    if not ins and not outs:  # (promote_types, sym sizes: host bookkeeping, no kernel)
        return None
    if name in HOST_READS:
        return Op(name, "host read (a GPU sync)", "", "", 0.0, 0.0, 0.0)
    in_dtypes = ",".join(sorted({str(t.dtype).replace("torch.", "") for t in ins if t.is_floating_point()}))
    out_dtype = ",".join(sorted({str(t.dtype).replace("torch.", "") for t in outs})) or "-"
    written = _written_in_place(func, args, kwargs)
    if name in ROW_READS:
        moved = 2 * sum(map(_nbytes, outs)) + sum(_nbytes(t) for t in ins if not t.is_floating_point())
    elif name == "copy_":
        moved = _nbytes(args[0]) + _nbytes(args[1])
    elif name in ROW_WRITES:
        # writes the source's rows into the destination and never reads the destination (its other rows stay)
        index, source = args[2], args[3]  # (self, dim, index, source)
        moved = 2 * _nbytes(source) + _nbytes(index)
    elif name in ("zeros", "zero_", "fill_", "full", "ones", "zeros_like", "full_like", "ones_like", "new_zeros",
                  "new_full", "new_ones"):
        moved = sum(map(_nbytes, written or outs))
    else:
        # reads every input (an in-place op's destination included), writes its outputs (in place: the destinations)
        moved = sum(map(_nbytes, ins)) + sum(map(_nbytes, written or outs))
    flops = 0.0
    if name in MATMULS:
        a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        flops = 2.0 * a.numel() * (b.shape[-1] if b.dim() > 1 else 1)  # [.., m, k] x [.., k, n]
        kind = "matmul " + ("bf16" if a.dtype in (torch.bfloat16, torch.float16) else "fp32")
        rate = BF16_FLOPS if a.dtype in (torch.bfloat16, torch.float16) else FP32_FLOPS
    elif name in ATTENTION_FORWARD or name in ATTENTION_BACKWARD:
        flops = _attention_flops(name, args)
        kind = "attention " + ("backward" if name in ATTENTION_BACKWARD else "forward")
        rate = BF16_FLOPS if ins[0].dtype in (torch.bfloat16, torch.float16) else FP32_FLOPS
    else:
        rate = 1.0
        kind = _memory_kind(name, ins, outs, params)
    seconds = max(flops / rate if flops else 0.0, moved / BANDWIDTH)
    return Op(name, kind, in_dtypes, out_dtype, flops, moved, seconds)


def _memory_kind(name: str, ins, outs, params: set[int]) -> str:
    if name.startswith(("_fused_adam", "_foreach_")) or name in ("_fused_adamw_",):
        return "optimizer / clipping"
    if name == "_to_copy" and ins and outs and ins[0].dtype != outs[0].dtype:
        source = ins[0].untyped_storage().data_ptr() in params
        return "cast of a weight" if source else "cast of an activation"
    if name in ("_to_copy", "clone", "copy_", "cat", "stack", "repeat_interleave", "index_select", "index_copy_",
                "index_add_", "index_put_", "gather", "scatter", "scatter_add", "constant_pad_nd", "repeat",
                "_unsafe_index", "slice_scatter", "select_scatter", "as_strided_scatter", "contiguous"):
        return "copy / layout"
    if name.startswith(("embedding", "nll_loss", "_log_softmax", "log_softmax", "logsumexp", "cross_entropy")):
        return "embedding / loss"
    if name in ("zeros", "zero_", "fill_", "full", "ones", "zeros_like", "full_like", "ones_like", "new_zeros"):
        return "fill"
    return "elementwise / reduction"


@dataclass
class Recorder(TorchDispatchMode):
    params: set[int]
    ops: list[Op] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = classify(func, args, kwargs, out, self.params)
        if op is not None:
            self.ops.append(op)
        return out


def model_config(preset: str, layers: int, tokens: int):
    from longctx.config import load_config

    m = load_config(None, {"model": {"preset": preset, "max_seq_len": max(tokens, 8192)}}).model
    return m if layers is None else __import__("dataclasses").replace(m, layers=layers)


def ours_step(preset: str, layers: int, tokens: int, loss_chunk: int, clip: float = 1.0):
    """The model, memory policy, loss forward, clipping and (fused) AdamW of `longctx train --memory.recompute
    full` at one process, as closures: (params, step)."""
    from longctx.config import load_config
    from longctx.models.llama import build_model
    from longctx.parallel.parallelize import apply_memory
    from longctx.step.gradients import clip_gradients
    from longctx.step.loss import forward_loss_sum

    cfg = load_config(None, {"memory": {"recompute": "full", "loss_chunk": loss_chunk}})
    model = build_model(model_config(preset, layers, tokens), "cpu", seed=0)
    apply_memory(model, cfg.memory, "cpu")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # (fused: what a GPU run uses)
    g = torch.Generator().manual_seed(0)
    tokens_t = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=g)
    batch = SimpleNamespace(tokens=tokens_t, positions=torch.arange(tokens)[None], doc_ids=None,
                            labels=torch.roll(tokens_t, -1, 1))

    def step():
        loss = forward_loss_sum(model, batch, torch.bfloat16) / tokens
        loss.backward()
        clip_gradients(model, clip)  # (train.grad_clip = 1.0 by default; the peer does not clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


def peer_step(preset: str, layers: int, tokens: int):
    """transformers' LlamaForCausalLM as benchmarks/peer_train.py builds it (SDPA, gradient checkpointing,
    fused AdamW, bf16 autocast over fp32 weights, no clipping)."""
    import transformers

    from longctx.config.hf_export import hf_config_from_model

    m = model_config(preset, layers, tokens)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config_from_model(m).items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, m.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


def record(which: str, preset: str, layers: int, tokens: int, loss_chunk: int) -> dict:
    """{signature: (seconds, flops, bytes, count)} of one step (the second: the first makes AdamW's state)."""
    model, step = ours_step(preset, layers, tokens, loss_chunk) if which == "ours" else \
        peer_step(preset, layers, tokens)
    step()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    rec = Recorder(params)
    t0 = time.perf_counter()
    with rec:
        step()
    wall = time.perf_counter() - t0
    table: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for op in rec.ops:
        row = table[(op.kind, op.name, op.in_dtypes, op.out_dtype)]
        row[0] += op.seconds
        row[1] += op.flops
        row[2] += op.bytes
        row[3] += 1
    return {"table": dict(table), "cpu_seconds": wall}


def extrapolate(runs: dict, layers: int, target: int) -> dict:
    """Per signature: estimated seconds per token at `target` tokens and `layers` layers, from runs
    {(layers, tokens): table} at layers 1 and 2 and two token counts."""
    (s1, s2) = sorted({t for _, t in runs})
    keys = set().union(*(r.keys() for r in runs.values()))
    out = {}
    def at(key, l_, t, i):
        row = runs[(l_, t)].get(key)
        return row[i] if row else 0.0

    for key in keys:
        def whole(t, i=0, key=key):  # the full depth at t tokens
            return at(key, 1, t, i) + (layers - 1) * (at(key, 2, t, i) - at(key, 1, t, i))

        if key[0].startswith("attention"):
            # its FLOPs at the peak: a short run's kernel is bound by the bytes of q, k, v (and on CPU of k and v
            # repeated per query head, which the GPU's kernels do not do), a long one by its FLOPs
            rate = BF16_FLOPS if "float32" not in key[2].split(",") or "bfloat16" in key[2] else FP32_FLOPS
            per_token = whole(s2, 1) / rate / s2 * (target / s2)
        else:
            b = (whole(s2) - whole(s1)) / (s2 - s1)  # per token
            a = whole(s2) - b * s2  # per step
            per_token = a / target + b
        count = whole(s2, 3)
        out[" | ".join(map(str, key))] = {"us_per_token": per_token * 1e6, "ops_per_step_at_run": count}
    return out


def by_class(est: dict) -> dict:
    classes: dict[str, float] = defaultdict(float)
    for key, v in est.items():
        classes[key.split(" | ")[0]] += v["us_per_token"]
    return dict(sorted(classes.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--tokens", default="1024,2048", help="two token counts to run at")
    ap.add_argument("--target", type=int, default=8192, help="tokens per step to estimate for")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="the run's memory.loss_chunk at the target")
    ap.add_argument("--which", default="ours,peer")
    ap.add_argument("--measured", default="ours=45.79,peer=31.48",
                    help="measured us per token at the target (H200 2026-12-04: 21,837 and 31,770 tokens/s)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    counts = [int(s) for s in args.tokens.split(",")]
    layers = model_config(args.preset, None, args.target).layers
    chunks = max(1, math.ceil(args.target / args.loss_chunk))
    measured = dict((k, float(v)) for k, v in (x.split("=") for x in args.measured.split(",") if x))
    result = {"preset": args.preset, "target_tokens": args.target, "layers": layers, "run_tokens": counts,
              "peaks": {"bf16_flops": BF16_FLOPS, "fp32_flops": FP32_FLOPS, "bytes_per_s": BANDWIDTH}, "sides": {}}
    for which in args.which.split(","):
        runs, cpu = {}, 0.0
        for n_layers in (1, 2):
            for t in counts:
                r = record(which, args.preset, n_layers, t, max(1, t // chunks))
                runs[(n_layers, t)], cpu = r["table"], cpu + r["cpu_seconds"]
        est = extrapolate(runs, layers, args.target)
        total = sum(v["us_per_token"] for v in est.values())
        kernels = defaultdict(float)
        for key, v in est.items():
            kernels[key.split(" | ")[0]] += v["ops_per_step_at_run"]
        side = {"estimated_us_per_token": total, "classes_us_per_token": by_class(est),
                "kernels_per_step": sum(kernels.values()) - kernels["host read (a GPU sync)"],
                "host_reads_per_step": kernels["host read (a GPU sync)"],
                "ops": dict(sorted(est.items(), key=lambda kv: -kv[1]["us_per_token"])), "cpu_seconds": cpu}
        if which in measured:
            side["measured_us_per_token"] = measured[which]
            side["measured_over_estimate"] = measured[which] / total
        result["sides"][which] = side
        print(json.dumps({which: {k: v for k, v in side.items() if k != "ops"}}, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
