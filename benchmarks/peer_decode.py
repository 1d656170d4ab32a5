"""Batch-1 decoding against a peer on the same card (issue 52 item 3): longctx's compiled decode step
(models/static_decode.py: a static cache, CUDA graphs on a GPU) against transformers' `generate` with its
static cache (`cache_implementation="static"`, whose decoding forward transformers compiles itself on a
GPU), on a model of SmolLM2-135M-Instruct's shape, in one process and one run.

    python benchmarks/peer_decode.py --device cuda --prompt-len 1024 --new-tokens 256 --repeats 3 --out X.json

The weights are random (SmolLM2's config: 30 layers, dim 576, 9 query / 3 kv heads, ffn 1536, vocab
49,152, tied embeddings, RoPE theta 100,000), written by transformers and read by longctx from the same
directory, so both decode the same model; a decode step's time does not depend on the weights' values,
and the real checkpoint (93 MB) is more than one device call can carry. With --checkpoint DIR (an HF
directory, e.g. benchmarks/fetch_smollm2.py's) that model is used instead. bf16 on a GPU, fp32 on CPU.

Each side decodes --new-tokens greedily from the same random prompt, EOS ignored, untimed twice first
(compilation, CUDA graph capture), then --repeats timed runs alternating; the best decode rate of each
counts (median beside it). Decode rate: the tokens after the first over the time from the first to the
last (transformers: a streamer stamps each token's arrival; longctx: generate/engine.py's own timing).
`same_tokens`: the share of runs whose tokens agree (bf16 kernels differ in rounding between the two, and a
random model's logits are close, so a split is not a bug; fp32 on CPU agrees). Glue check on CPU:
    python benchmarks/peer_decode.py --device cpu --layers 2 --prompt-len 64 --new-tokens 16 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}


def write_model(directory: Path, layers: int, seed: int) -> None:
    """A SmolLM2-shaped Llama with random weights, saved by transformers into `directory` (fp32)."""
    import transformers

    cfg = transformers.LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers}, initializer_range=0.1)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(directory)


def theirs_once(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # the prompt first, then each new token
            if prompt.device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    stamps = Stamps()
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=stamps,
                             cache_implementation="static")
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    tokens = out[0, prompt.shape[1]:].tolist()
    return {"tokens": tokens, "decode_tokens_per_s": (len(tokens) - 1) / (end - stamps.times[1])}


def ours_once(model, prompt: list[int], new_tokens: int, step) -> dict:
    from longctx.generate.engine import generate

    r = generate(model, [prompt], max_new_tokens=new_tokens, compile=step)[0]
    return {"tokens": r.tokens, "decode_tokens_per_s": r.decode_tokens_per_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--checkpoint", default="", help="an HF directory to decode instead of the random model")
    ap.add_argument("--layers", type=int, default=30, help="the random model's layers (SmolLM2: 30)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import transformers

    from longctx.models.hf import load_hf
    from longctx.models.static_decode import CompiledStep

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or tmp
        if not args.checkpoint:
            write_model(Path(tmp), args.layers, args.seed)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        ours = load_hf(path).to(device=dev, dtype=dtype).eval()
    theirs.generation_config.eos_token_id = None  # every run makes exactly --new-tokens tokens
    vocab = theirs.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    step = CompiledStep()
    sides = {"longctx": lambda: ours_once(ours, prompt[0].tolist(), args.new_tokens, step),
             "transformers": lambda: theirs_once(theirs, prompt.to(dev), args.new_tokens)}
    warm = {}
    for name, once in sides.items():  # untimed: compilation and graph capture
        t0 = time.perf_counter()
        once(), once()
        warm[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: warm-up (2 runs) {warm[name]} s", file=sys.stderr, flush=True)
    runs = {name: [] for name in sides}
    for i in range(args.repeats):
        for name, once in sides.items():
            runs[name].append(once())
        print(f"run {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]['decode_tokens_per_s']:.1f}"
                                                         for k, v in runs.items()), file=sys.stderr, flush=True)
    rates = {k: [r["decode_tokens_per_s"] for r in v] for k, v in runs.items()}
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    result = {
        "benchmark": "peer_decode", "card": card, "device": dev.type, "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "transformers_version": transformers.__version__,
        "model": args.checkpoint or f"SmolLM2-135M shape, random weights, {args.layers} layers",
        "batch": 1, "prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "warm_up_s": warm, "compiled_calls": step.calls,
        **{k: {"decode_tokens_per_s": max(v), "decode_tokens_per_s_median": statistics.median(v), "runs": v}
           for k, v in rates.items()},
        "decode_ratio": max(rates["longctx"]) / max(rates["transformers"]),
        "same_tokens": sum(a["tokens"] == b["tokens"] for a, b in zip(runs["longctx"], runs["transformers"]))
        / args.repeats,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
