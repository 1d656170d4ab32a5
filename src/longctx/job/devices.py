"""This process's device, precision and seeds: `train.device` (auto: CUDA when there is one),
`train.dtype` (auto: bf16 on a CUDA device that computes it natively, fp32 elsewhere), every
random generator seeded alike, and `train.deterministic`'s kernels."""

from __future__ import annotations

import os
import platform
import random
import subprocess
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..errors import ConfigError


def machine_record() -> dict:
    """The machine figures were measured on, as benchmarks' JSON records it, with the code that measured them."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "code": code_record()}


def code_record() -> dict:
    """The longctx that measured a figure: its version, and where it runs from a git checkout, the commit and
    whether the package's files differ from it (a figure from uncommitted code says so). Without git (an installed
    copy, or the lent GPU machine's copy of the working tree, which has no .git): $LONGCTX_COMMIT, else None."""
    package = Path(__file__).resolve().parents[1]
    record = {"version": __version__, "commit": None, "dirty": None}
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()

        # (the package's files tracked there: an installed copy in a venv inside another repository, ignored by it,
        # would otherwise record that repository's commit, clean)
        if not git("ls-files", "--", "__init__.py"):
            raise subprocess.SubprocessError("the package is not tracked by the repository around it")
        record["commit"] = git("rev-parse", "HEAD")
        record["dirty"] = bool(git("status", "--porcelain", "--", "."))
    except (OSError, subprocess.SubprocessError):  # (a copy without .git, the lent GPU's: the caller may say it)
        record["commit"] = os.environ.get("LONGCTX_COMMIT") or None
    return record


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# cuBLAS's workspace configurations under which its GEMMs are deterministic (CUDA's and torch's
# reproducibility notes: torch refuses a cuBLAS call under the deterministic mode with any other); read
# when cuBLAS starts in the process, so set before the first matmul
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def use_deterministic_algorithms() -> None:
    """train.deterministic: torch's deterministic kernels for the rest of the process (an op that has none
    raises, naming itself; SDPA's flash and efficient backwards take their deterministic paths, cuDNN's
    attention is excluded), cuDNN deterministic without autotuning, and cuBLAS's deterministic workspace
    (the environment's, where it sets one of the two). Called before the job starts CUDA."""
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC[0])
    if workspace not in CUBLAS_DETERMINISTIC:
        raise ConfigError(f"train.deterministic needs cuBLAS's deterministic workspace, CUBLAS_WORKSPACE_CONFIG "
                          f"{' or '.join(CUBLAS_DETERMINISTIC)}, but the environment sets {workspace!r} (torch would "
                          f"refuse the first matrix product); unset it or set one of those.")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def resolve_device(choice: str, option: str = "train.device") -> torch.device:
    """auto | cpu | cuda -> the device; `option` names the setting in the error (a CLI flag elsewhere)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{option}=cuda but no CUDA device is available; use {option}=auto or cpu.")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def native_bf16(device_type: str, start_cuda: bool = True) -> bool:
    """This process's CUDA device computes bf16 natively (compute capability 8.0 on: Ampere, Hopper, ...).
    Older cards (V100, T4) only emulate it, slower than fp32, so `auto` does not pick it there. Asking
    starts CUDA in this process; a launcher that must not (the context would hold GPU memory through the
    run) passes start_cuda=False and, if CUDA has not started, counts on a native card."""
    if device_type != "cuda":
        return False
    if not start_cuda and not torch.cuda.is_initialized():
        return True
    return torch.cuda.is_bf16_supported(including_emulation=False)


def computes_in_bf16(choice: str, device_type: str, start_cuda: bool = True) -> bool:
    """Whether train.dtype `choice` (auto | fp32 | bf16) computes in bf16 on `device_type`: the one place
    that decides it (autocast, FSDP's gathers and the host budget's byte counts all ask here)."""
    if choice not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.dtype={choice!r}: expected auto, fp32 or bf16")
    return native_bf16(device_type, start_cuda) if choice == "auto" else choice == "bf16"


def resolve_dtype(choice: str, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if computes_in_bf16(choice, device.type) else torch.float32
