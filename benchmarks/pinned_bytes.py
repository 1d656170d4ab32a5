"""Pinned host memory as torch locks it, measured on a GPU (ops/pinned.py, costs/host_bytes.py): prints JSON.

- one pinned tensor of 2^28 + 4096 bytes: the RSS it adds against ops/pinned.py pinned_bytes (2^29 where
  torch's caching host allocator rounds to a power of two) and its exact size;
- small-100m's fp32 weights and gradients pinned per tensor against carved out of power-of-two slabs
  (planned_pinned_bytes);
- HostOptimizer on small-100m: the RSS its construction adds against costs/host_bytes.py's pinned
  masters + gradient buffers, and a resume's moments not pinned (a fresh run's are not).

    python3 benchmarks/pinned_bytes.py > $OUT/pinned_bytes.json     (about a minute on one GPU)

Without CUDA it prints {"skipped": ...}: nothing is pinned on a CPU."""

from __future__ import annotations

import gc
import json
import sys

import torch


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _grown(make):
    """(what make() returned, the RSS it added)."""
    gc.collect()
    before = _rss()
    out = make()
    return out, _rss() - before


def main() -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: nothing is pinned on a CPU"}
    from longctx.config import load_config
    from longctx.costs.host_bytes import pinned_fp32_shard_bytes
    from longctx.costs.shape import MeshShape
    from longctx.models.llama import build_model
    from longctx.ops import pinned
    from longctx.step.host_optimizer import HostOptimizer, forward_units

    torch.empty(1, pin_memory=True)  # the CUDA context and the host allocator, before any baseline
    # (every allocation below stays alive to the end: a freed pinned block is cached by torch and would serve
    # a later request of its size without adding RSS)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    n = 2**28 + 4096
    t, grown = _grown(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    out["one_tensor"] = {"bytes": n, "rss_added": grown, "predicted": pinned.pinned_bytes(n)}
    m = load_config(None, {"model": {"preset": "small-100m"}}).model
    shapes = [(p.shape, torch.float32) for p in build_model(m, "meta").parameters()] * 2
    exact = sum(s.numel() * 4 for s, _ in shapes)
    per_tensor, grown = _grown(lambda: [torch.empty(s, dtype=d, pin_memory=True) for s, d in shapes])
    out["per_tensor"] = {"exact": exact, "rss_added": grown,
                         "predicted": sum(pinned.pinned_bytes(s.numel() * 4) for s, _ in shapes)}
    carved, grown = _grown(lambda: pinned.carve(shapes, True))
    out["carved"] = {"exact": exact, "rss_added": grown,
                     "predicted": pinned.planned_pinned_bytes([s.numel() * 4 for s, _ in shapes]),
                     "all_pinned": all(t.is_pinned() for t in carved)}
    model = build_model(m, "cuda")
    opt, grown = _grown(lambda: HostOptimizer([{"params": list(model.parameters())}], forward_units(model), lr=1e-4))
    out["host_optimizer"] = {"rss_added": grown, "predicted": 2 * pinned_fp32_shard_bytes(m, MeshShape(), True)}
    tokens = torch.randint(0, m.vocab_size, (1, 256), device="cuda")
    model(tokens, None, None, labels=tokens).backward()
    opt.step()
    opt.finish_update()
    saved = opt.state_dict()
    fresh = any(v.is_pinned() for s in opt.state.values() for k, v in s.items() if k != "step")
    opt.load_state_dict(saved)
    resumed = any(v.is_pinned() for s in opt.state.values() for k, v in s.items() if k != "step")
    out["moments_pinned"] = {"fresh": fresh, "resumed": resumed}
    del t, per_tensor, carved
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=1)
    print()
