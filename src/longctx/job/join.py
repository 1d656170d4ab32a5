"""Joining the job: this process's process group, its layout checked against the world, its Runtime
and its device. What every entry point that runs on ranks (train, eval, generate) does first."""

from __future__ import annotations

import torch

from ..config import Config
from .checks import check_layout
from .devices import resolve_device
from .host_malloc import keep_freed_blocks, return_freed_blocks
from .launch import init_distributed, init_one_rank_group
from .runtime import Runtime


def join_job(cfg: Config, training: bool = False) -> tuple[Runtime, torch.device]:
    """This process's place in the job (its process group joined, its layout checked) and its device.
    `training`: a training run, whose memory.model_states tier (host_optimizer, host) plans host memory."""
    device = resolve_device(cfg.train.device)
    if device.type == "cpu":  # (host_malloc.py) freed activations reused, not faulted in again each step;
        # a training run of the host tiers plans host memory, so its RSS is what is live
        host_tier = training and cfg.memory.model_states != "device"
        return_freed_blocks() if host_tier else keep_freed_blocks()
    host_states = cfg.memory.model_states == "host"  # weights in host memory: FSDP2's CPU offload
    rank, world = init_distributed(device.type, cfg.parallel.timeout_s, host_states)
    if world == 1 and host_states:
        init_one_rank_group(device.type, host_states)
    check_layout(cfg, world)
    rt = Runtime.create(cfg, rank, world, device.type)
    return rt, (rt.device if device.type == "cuda" else device)
