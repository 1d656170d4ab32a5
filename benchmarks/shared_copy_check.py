"""Models differing only in RoPE's frequencies (rope_theta, a linear or llama3 scaling) share one compiled
decode copy (models/compiled_copies.py, static_decode.model_key: the frequencies reach the graph as the
`inv_freq` tensor). On a CPU the tests hold it with inductor's C++ kernels; on a GPU the copy runs under
reduce-overhead (CUDA graph trees), where a graph recorded for one model's buffers must not replay stale
frequencies for another's. This check decodes each model eagerly and compiled, in turn and then again in
reverse order (a replay after the other models' runs), and writes whether the tokens are the same, the
graphs dynamo compiled and the copies kept (JSON):

    python benchmarks/shared_copy_check.py --device cuda --out /tmp/shared_copy.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from longctx.config import load_config
from longctx.generate.engine import generate
from longctx.models import compiled_copies
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep

# (the same weights, only the frequencies differ; init_std 0.1: attention sharp enough that they change tokens)
VARIANTS = [{}, {"rope_theta": 500.0}, {"rope_theta": 1e6}, {"rope_scaling": "linear", "rope_factor": 4.0},
            {"rope_scaling": "llama3", "rope_theta": 50.0}]
PROMPTS = [[5, 6, 7, 11, 13, 17, 19, 23], [8, 9, 10]]


def _tokens(model, compile, new: int) -> list[list[int]]:
    return [r.tokens for r in generate(model, PROMPTS, max_new_tokens=new, compile=compile)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--mode", default=None, help="torch.compile's mode (default: reduce-overhead on a GPU)")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend (the glue test: eager)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    base = load_config(overrides=["--model.preset=debug", "--model.layers=2"]).model
    models = [build_model(dataclasses.replace(base, init_std=0.1, **v), seed=0).to(a.device).eval() for v in VARIANTS]
    step = CompiledStep(mode=a.mode, backend=a.backend)
    eager = [_tokens(m, None, a.new_tokens) for m in models]
    torch._dynamo.utils.counters.clear()
    start, rows = time.perf_counter(), []
    for order in ("forward", "reverse"):
        for i in (range(len(models)) if order == "forward" else reversed(range(len(models)))):
            rows.append({"variant": VARIANTS[i], "order": order,
                         "identical": _tokens(models[i], step, a.new_tokens) == eager[i]})
    result = {"device": a.device, "card": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "mode": step.mode or ("reduce-overhead" if a.device.startswith("cuda") else "default"),
              "rows": rows, "all_identical": all(r["identical"] for r in rows),
              "tokens_differ_between_variants": len({str(t) for t in eager}),
              "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
              "copies": len(compiled_copies.COPIES), "seconds": round(time.perf_counter() - start, 1)}
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
