"""Each rank's random generators in a checkpoint (`rng-rank{r}.pt`): python, numpy, torch CPU and
the current CUDA device's, saved with the training state and restored on resume.

Checkpoint files are data, never code: every torch.load here runs with weights_only=True. The
states are therefore stored as tensors, tuples and numbers only (numpy's key array as a tensor).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from .manifest import CheckpointError


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def local_state_file(rank: int) -> str:
    """A rank's own training state beside its RNG's (CheckpointManager.rank_state: CO2's replicas)."""
    return f"local-rank{rank}.pt"


def _rng_state() -> dict:
    """This process's generators: python, numpy, torch CPU, and the current CUDA device's when this
    process uses CUDA (only that one: asking for every device's would create a context on each)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict, cuda: bool) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # an ndarray in older checkpoints
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if cuda and "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _load_rng(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no {path.name}: it was written by an older longctx, before each "
                              f"rank's RNG state was saved; resume from a checkpoint of this version (or start the "
                              f"weights over with --model.init_from {path.parent}).")
    return torch.load(path, weights_only=True)


def restore_rng(path: Path, manifest: dict, rank: int, world: int) -> None:
    """This rank's generators from the checkpoint at `path` (`manifest`: its manifest), on resume."""
    own = path / rng_file(rank)
    if manifest["layout"].get("world") == world and own.is_file():
        _set_rng_state(_load_rng(own), cuda=True)
        return
    # Another world size: the ranks have no one-to-one counterparts in the saved job, so every rank
    # continues rank 0's CPU streams (what a single process would, and what all ranks did before
    # RNG states were saved per rank). CUDA generators keep their seeded state: the devices differ.
    _set_rng_state(_load_rng(path / rng_file(0)), cuda=False)
