"""memory.model_states = host on an accelerator: FSDP2's CPU offload refuses (in its lazy init, at the first
forward) any sharded parameter materialised off the host. A GPU run built the model with to_empty(device=cuda)
and failed there (docs/results/gpu_frontier_nvidia-h200_2026-12-04.json, smoke host). parallel/fsdp/shard.py
materialize puts the parameters in host memory and the buffers on the device; the "meta" device stands in
for the accelerator here (a CPU machine has none), the contract being FSDP2's: parameters on "cpu"."""

import torch

from longctx.config import Config, build_model_config
from longctx.models.llama import build_model
from longctx.parallel.fsdp.shard import materialize


def _cfg(tier: str) -> Config:
    cfg = Config()
    cfg.model = build_model_config({"preset": "debug-moe"})
    cfg.memory.model_states = tier
    return cfg


def _built(cfg: Config):
    return build_model(cfg.model, device="meta")


def test_host_tier_materializes_parameters_in_host_memory_and_buffers_on_the_device():
    cfg = _cfg("host")
    model = _built(cfg)
    materialize(model, cfg, torch.device("meta"))
    params = {n: p.device.type for n, p in model.named_parameters()}
    buffers = {n: b.device.type for n, b in model.named_buffers()}
    assert params and set(params.values()) == {"cpu"}, params
    # inv_freq and the routers' expert_bias at least: forward reads them where it computes
    assert any(n.endswith("inv_freq") for n in buffers) and any(n.endswith("expert_bias") for n in buffers)
    assert set(buffers.values()) == {"meta"}, buffers


def test_other_tiers_materialize_everything_on_the_device():
    for tier in ("device", "host_optimizer"):
        cfg = _cfg(tier)
        model = _built(cfg)
        materialize(model, cfg, torch.device("meta"))
        assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    cfg = _cfg("host")  # on a CPU run host and device are one memory
    model = _built(cfg)
    materialize(model, cfg, torch.device("cpu"))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}
