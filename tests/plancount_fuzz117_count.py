"""The independent counts of tests/unit/test_plancount_fuzz117.py and tests/distributed/test_plancount_fuzz117_ranks.py.

- `draw_model`: a random tiny model config (dense or MoE, grouped-query heads, tied embeddings, q/k norms over a
  head or the whole projection, shared experts with or without their gate, odd widths) that the config rules accept;
  `draw_policy`: a random [memory] policy (recompute none / full / selective, an offload fraction, block, loss and
  expert chunks).
- `saved_bytes`: what one forward leaves for backward, taken from autograd's own saved tensors: every tensor a
  torch.autograd.graph.saved_tensors_hooks pack hook is handed (a checkpoint's inputs included: non-reentrant
  checkpointing saves them through the hooks outside it), still alive after the forward, by storage (a storage
  saved twice, or through several views, is held once, whole), less the storages that existed before the forward
  (parameters, buffers, the batch). Inside an offloaded block the host offloader's own hook is the one autograd
  calls: what it returns is read instead, its host part as host bytes and the part it keeps as device bytes.
  Besides autograd, the one holder of forward tensors until backward is a MoE layer's list of router records (per
  call: the balancing losses' statistics): their tensors are read from the records. Not memory/measured.py's
  dispatch-mode tracker, nor any accounting code. (Not seen: what autograd holds outside saved tensors, e.g. a
  tied weight's first gradient share waiting in its accumulation buffer.)
- `state_bytes`: the bytes of the storages behind a rank's parameters (a DTensor's local shard: FSDP2's padded
  storage), their gradients and the optimizer's state tensors, by storage.
"""

from __future__ import annotations

import gc
import random
import weakref

import torch

from longctx.config import load_config
from longctx.memory.offload import HostOffloader


def draw_model(seed: int, moe: bool | None = None) -> dict:
    """A random tiny model's [model] keys."""
    rng = random.Random(seed)
    moe = seed % 3 == 2 if moe is None else moe
    heads = rng.choice([2, 3, 4, 6])
    kv = rng.choice([k for k in (1, 2, 3, heads) if heads % k == 0])
    model = {"preset": "debug-moe" if moe else "debug", "dim": rng.choice([12, 20, 24, 36]),
             "layers": rng.randint(2, 4), "heads": heads, "kv_heads": kv, "head_dim": rng.choice([4, 6, 8]),
             "ffn_dim": rng.choice([18, 30, 44]), "vocab_size": rng.choice([37, 61, 101]),
             "tie_embeddings": rng.random() < 0.4, "init_std": 0.2}
    qk = rng.choice(["", "head", "all"] if moe else ["", "head"])  # (only olmoe normalises whole projections)
    if qk:
        model.update({"family": "qwen3_moe" if moe else "qwen3", "qk_norm": True, "qk_norm_span": qk})
        if qk == "all":
            model["family"] = "olmoe"
    elif not moe and rng.random() < 0.3:
        model.update({"family": "qwen2", "qkv_bias": True})
    if moe:
        experts = rng.randint(2, 7)
        model.update({"moe.experts": experts, "moe.top_k": min(experts, rng.choice([1, 2, 3])),
                      "moe.expert_dim": rng.choice([10, 14, 22]), "moe.dense_layers": rng.choice(["0", ""]),
                      "moe.aux_loss": 0.0, "moe.z_loss": 0.0})
        if rng.random() < 0.5:
            model.update({"moe.shared_experts": 1, "moe.shared_dim": rng.choice([8, 18]),
                          "moe.shared_gate": rng.random() < 0.5})
    return model


def draw_policy(seed: int, moe: bool) -> dict:
    """A random [memory] policy."""
    rng = random.Random(7919 * seed + 1)
    recompute = rng.choice(["none", "full", "selective"])
    offload = 0.0 if recompute == "none" else rng.choice([0.0, 0.0, 1.0, 0.5, round(rng.uniform(0.1, 0.9), 2)])
    return {"recompute": recompute, "offload_fraction": offload,
            "offload_skip_last": rng.choice([0, 1, 1]) if offload else 1,
            "block_chunk": 0 if recompute == "none" else rng.choice([0, 0, 24, 40]),
            "loss_chunk": rng.choice([0, 0, 16, 48]), "attention_chunk": rng.choice([0, 0, 0, 20]),
            "expert_chunk": rng.choice([0, 0, 16]) if moe else 0}


def config(model: dict, memory: dict | None = None, parallel: dict | None = None, **train):
    """The validated Config of a model draw and a policy draw (fp32), under a layout's [parallel] keys."""
    return load_config(overrides={"model": model, "memory": memory or {}, "parallel": parallel or {},
                                  "train": {"dtype": "fp32", **train}})


def _storage(t: torch.Tensor):
    t = t.to_local() if hasattr(t, "to_local") else t
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def saved_bytes(model, tokens, labels, bf16: bool = False) -> tuple[int, int, object]:
    """(device bytes, host bytes, the loss) held for backward after one forward of `model` (see the module); `bf16`:
    under bf16 autocast, uncached, as a training step on CPU runs it (step/loss.py)."""
    before = ({_storage(t)[0] for t in [*model.parameters(), *model.buffers()]}
              | {_storage(tokens)[0], _storage(labels)[0]})
    seen: list = []
    offloader_pack = HostOffloader._pack

    def pack(t):
        seen.append(weakref.ref(t))
        return t

    def spied_pack(self, t):
        out = offloader_pack(self, t)
        seen.append(weakref.ref(out) if isinstance(out, torch.Tensor) else out)
        return out

    HostOffloader._pack = spied_pack
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            loss = model(tokens, labels=labels)
    finally:
        HostOffloader._pack = offloader_pack
    gc.collect()
    device, host = {}, {}
    for record in (r for layer in model.modules() for r in getattr(layer, "records", [])):
        for t in vars(record).values():
            if isinstance(t, torch.Tensor) and _storage(t)[0] not in before:
                device.setdefault(*_storage(t))
    for item in seen:
        if isinstance(item, weakref.ref):
            t = item()
            if t is not None:
                ptr, n = _storage(t)
                if ptr and ptr not in before:
                    device[ptr] = n
            continue
        region = item.region  # an offloaded span: its host part, and the part left on the device
        ptr, n = _storage(region.host)
        host[ptr] = n
        if region.rest is not None:
            ptr, n = _storage(region.rest)
            device[ptr] = n
    return sum(device.values()), sum(host.values()), loss


def state_bytes(model, opt) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes (by storage) of a rank's model states, wherever they live."""
    out = {}
    for part, tensors in (("params", list(model.parameters())),
                          ("grads", [p.grad for p in model.parameters() if p.grad is not None]),
                          ("optimizer", [v for s in opt.state.values() for v in s.values()
                                         if isinstance(v, torch.Tensor) and v.dim() > 0])):
        out[part] = sum(dict(_storage(t) for t in tensors).values())
    return out
