"""What a generation runs on, from a config: the checkpoint's model on a device, the tokens that end a
generation (EOS), and this process's backend (one device, or its rank of a head x ctx layout).

Library functions: `longctx generate` (generate/cli.py), `eval --mode generate`, `bench decode` and a
plain draft model (generate/drafts.py) all load through here; `check_window` is the one sliding-window rule
that the decode loop (generate/loop.py) and, before any weight is read, those commands apply.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError


def load_model(cfg, device, dtype):
    """The checkpoint's model on one device: built on meta, materialised, weights read (hf:DIR's
    safetensors, or a longctx checkpoint verified first), RoPE frequencies from the config."""
    import torch

    from ..checkpoint.manager import resolve_checkpoint
    from ..checkpoint.weights_only import load_model_weights
    from ..config.hf import hf_dir
    from ..job.runtime import on_rank_0
    from ..models.hf import load_hf_weights
    from ..models.llama import build_model

    model = build_model(cfg.model, device="meta")
    model.to_empty(device=device)
    source = cfg.model.init_from
    if source.startswith("hf:"):
        load_hf_weights(model, hf_dir(source))
    else:
        # (resolved once, on rank 0: a checkpoints directory names its latest step, which moves on while its run
        # saves, and ranks resolving it apart would each hold another step's weights, their cache shards two models)
        path = on_rank_0(lambda: resolve_checkpoint(source, Path(source)), "resolving --checkpoint")
        if path is None:
            raise ConfigError(f"--checkpoint {source} holds no complete checkpoint.")
        manifest = load_model_weights(path, model)
        model.set_router_step(int(manifest["step"]) - 1)  # (DTS-Gate routes as training did at that step)
    ratios = None
    if dtype != torch.float32:
        if model.ms_poe_ratios is not None:  # (Ms-PoE's heads ranked on the fp32 weights, as score mode ranks them)
            model.init_rope()
            ratios = model.ms_poe_ratios.clone()
        model.to(dtype)
    model.init_rope(ratios)  # (fp32, from the config: an extension applies to the loaded weights)
    return model.eval()


def check_weight_files(init_from: str, flag: str) -> None:
    """The weight files of `init_from` (hf:DIR, a longctx checkpoint) are all there, whole, and readable: hf:DIR's
    safetensors listed and their headers read (models/hf.py weight_files), a checkpoint's files at the sizes
    its manifest lists (checksums wait for the load). A draft's (`flag` --draft) is checked so before the
    target's weights are read: its load comes after them, and a partial save or download was found only then."""
    from ..checkpoint.manifest import verify
    from ..config.checkpoint_paths import find_checkpoint

    if init_from.startswith("hf:"):
        from ..config.hf import hf_dir
        from ..models.hf_files import weight_files

        weight_files(hf_dir(init_from))
        return
    found = find_checkpoint(init_from)
    if found is None:
        raise ConfigError(f"{flag} {init_from} holds no complete checkpoint.")
    verify(found, checksums=False)


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
            ids = [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]  # (a [null])
            if ids:
                return ids
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


def init_window(init_from: str) -> int:
    """The sliding window of the attention of the weights `init_from` names (hf:DIR, or a longctx checkpoint
    followed back to the config.json it started from: config/hf.py initial_hf_config), as transformers gives
    it to some layer (config/hf_families.py family_window); 0: none. Read before any config is built from
    them (eval refuses a length past it before its config would)."""
    from ..config.hf import initial_hf_config
    from ..config.hf_families import family_window

    return int(family_window(initial_hf_config(init_from) or {}) or 0)


def check_window(m, positions: int, where: str) -> None:
    """Refuse a generation of `positions` positions (a prompt and its new tokens) past the sliding window of
    the weights (`m`: their ModelConfig). longctx has no sliding-window attention: it attends to every
    earlier position, which is the window's attention only while a sequence is within it; past it the
    logits differ from transformers' (and from what the model trained with) by O(1), with no error. (The
    last new token is never fed, so window + 1 would still be exact; `longctx generate` caps at the window,
    config/positions.py's reach: one rule.)"""
    window = init_window(m.init_from)
    if not window or positions <= window:
        return
    raise ConfigError(f"{where}: a prompt and its new tokens take {positions:,} positions, past the {window:,}-token "
                      f"sliding window that the weights' config.json gives their attention: longctx attends to every "
                      f"earlier position, the same as the window only up to {window:,} positions, so past them the "
                      f"tokens would not be this model's. Keep each prompt + new tokens within {window:,}; or "
                      f"{window_ways_out(window, m.init_from)}.")


def window_ways_out(window: int, init_from: str) -> str:
    """The ways past a sliding window of `window` tokens that work (said by check_window and by generate's
    messages on a prompt past a window's reach, generate/prompts.py): InfLLM, or the weights run with full
    attention."""
    return (f"decode with InfLLM's context memory (--context-memory infllm), which keeps every distance within the "
            f"{window:,}-token window; or, to run the weights with full attention, {window_off(init_from)}")


def window_off(init_from: str) -> str:
    """How to run windowed weights (those of `init_from`) with full attention: the config.json key to change,
    said as the refusals of a length past the window end ("set sliding_window null in DIR/config.json")."""
    from ..config.hf import hf_dir, initial_hf, initial_hf_config
    from ..config.hf_families import window_off_keys

    off = window_off_keys(initial_hf_config(init_from) or {})
    source = initial_hf(init_from)
    return f"set {off} in {hf_dir(source) / 'config.json' if source else 'the config.json of the weights'}"


def dropless_notes(which: str, model) -> list[str]:
    """generate's (and bench decode's) note on a MoE capacity its decoding leaves out (generate/loop.py
    generating), for the target ("model") or a longctx draft ("draft"); none without one."""
    from ..models.moe_eval_routing import dropless_note

    note = model and dropless_note(model.moe_capacity_factor, f"the {which} generates",
                                   "a prompt's tokens depend on the prompts batched with it and on how its prefill "
                                   "is chunked")
    return [note] if note else []
