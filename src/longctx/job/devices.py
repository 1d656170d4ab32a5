"""This process's device, precision and seeds: `train.device` (auto: CUDA when there is one),
`train.dtype` (auto: bf16 on CUDA, fp32 elsewhere) and every random generator seeded alike."""

from __future__ import annotations

import random

import numpy as np
import torch

from ..errors import ConfigError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(choice: str, option: str = "train.device") -> torch.device:
    """auto | cpu | cuda -> the device; `option` names the setting in the error (a CLI flag elsewhere)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}=cuda but no CUDA device is available; use {option}=auto or cpu.")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]
