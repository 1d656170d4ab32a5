"""What a generation runs on, from a config: the checkpoint's model on a device, the tokens that end a
generation (EOS), and this process's backend (one device, or its rank of a head x ctx layout).

Library functions: `longctx generate` (generate/cli.py), `eval --mode generate`, `bench decode` and a
plain draft model (generate/drafts.py) all load through here.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError


def load_model(cfg, device, dtype):
    """The checkpoint's model on one device: built on meta, materialised, weights read (hf:DIR's
    safetensors, or a longctx checkpoint verified first), RoPE frequencies from the config."""
    import torch

    from ..checkpoint.manager import load_model_weights, resolve_checkpoint
    from ..config.hf import hf_dir
    from ..models.hf import load_hf_weights
    from ..models.llama import build_model

    model = build_model(cfg.model, device="meta")
    model.to_empty(device=device)
    source = cfg.model.init_from
    if source.startswith("hf:"):
        load_hf_weights(model, hf_dir(source))
    else:
        path = resolve_checkpoint(source, Path(source))
        if path is None:
            raise ConfigError(f"--checkpoint {source} holds no complete checkpoint.")
        manifest = load_model_weights(path, model)
        model.set_router_step(int(manifest["step"]) - 1)  # (DTS-Gate routes as training did at that step)
    if dtype != torch.float32:
        model.to(dtype)
    model.init_rope()  # (fp32, from the config: an extension applies to the loaded weights)
    return model.eval()


def eos_ids(init_from: str, tokenizer) -> list[int]:
    """The tokens that end a generation: the generation_config.json or config.json eos_token_id (an id or
    a list: an instruct model's end of turn among them) of the Hugging Face directory the weights started
    from (hf:DIR, or through checkpoints trained with its tokenizer: config/tokenizer.py source_hf), else
    the tokenizer's end-of-document token."""
    from ..config.tokenizer import source_hf

    source = source_hf(init_from)
    if source:
        from ..config.hf import hf_dir

        for name in ("generation_config.json", "config.json"):
            file = hf_dir(source) / name
            if not file.is_file():
                continue
            value = json.loads(file.read_text()).get("eos_token_id")
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
    eos = getattr(tokenizer, "eos_id", None)
    return [] if eos is None else [int(eos)]


def backend_for(cfg):
    """(backend, device, is rank 0) of this process: one device (generate/local.py), or, when
    cfg.parallel names a head x ctx layout, this rank's part of it (generate/sharded.py; the job
    joined here)."""
    from ..job.devices import resolve_device
    from .local import LOCAL

    if cfg.parallel.head * cfg.parallel.ctx == 1:
        return LOCAL, resolve_device(cfg.train.device), True
    from ..job.join import join_job
    from .sharded import ShardedGeneration

    rt, device = join_job(cfg)
    return ShardedGeneration(rt.mesh, rt.world_mesh), device, rt.is_main
