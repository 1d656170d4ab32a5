"""Starting weights: filling a materialised (possibly sharded) model from a source that model.init_from
or draft.target names. Below both model builders (model.py, glide.py), so neither imports the other
for it."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..checkpoint.manager import read_manifest, resolve_checkpoint
from ..checkpoint.weights_only import load_weights_into
from ..config.hf import hf_dir
from ..job.runtime import Runtime, on_main
from ..models.hf import load_hf_weights


def load_weights(model: nn.Module, source: str, rt: Runtime, log=print, flag: str = "model.init_from") -> Path:
    """Fill a materialised (possibly sharded) model from `source`: hf:DIR's safetensors or a longctx
    checkpoint (DIR, or a checkpoints directory for its latest), each rank reading its own shards;
    returns the directory read. `flag`: the setting that named it (errors say it)."""
    if source.startswith("hf:"):
        path = hf_dir(source)
        load_hf_weights(model, path)
    else:
        # (resolved once, on rank 0: a checkpoints directory names its latest step, which moves on while its run
        # saves, and ranks resolving it apart could fill one model with shards of two steps)
        path = Path(on_main(rt, lambda: str(resolve_checkpoint(source, Path(source))), f"resolving {flag}"))
        load_weights_into(path, model, rt, log, flag)
        # routers whose routing follows the step (DTS-Gate) route as the weights were trained: a run that
        # trains from here sets its own step before each forward
        model.set_router_step(int(read_manifest(path)["step"]) - 1)
    return path
