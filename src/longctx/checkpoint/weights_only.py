"""Only the model weights of a checkpoint, verified first: into a model of any layout (`model.init_from = DIR`,
`longctx eval`; each rank reads its shards) or into a single-process model (export, generate)."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from ..config.checkpoint_paths import CheckpointError
from ..progress import phase
from .counted_read import read_counted
from .manager import CheckpointManager, _single_process
from .manifest import check_weights_fit, damage_report, verify


def load_weights_into(path: Path, model, rt, log=print, flag: str = "model.init_from") -> dict:
    """Only the model weights of a checkpoint, verified first (the ranks split the checksums), into
    a model of any layout (each rank reads its shards): what `model.init_from = DIR` and
    `longctx eval` start from. RoPE frequencies are set from the model's own config afterwards, so
    an extension (rope_theta, rope_scaling) applies to the loaded weights. `flag`: the setting that named the
    checkpoint, for the errors (draft.target for a draft's target)."""
    manager = CheckpointManager(path.parent, keep=0, async_save=False, rank=rt.rank, world=rt.world, layout={},
                                model_cfg={}, log=log, create=False)
    # (phases, as load_model_weights' are: an 8B model's two reads are minutes each; the ranks' checksums are split
    # among them, so rank 0, which speaks, counts the MB of its own share, and says so: find_damage's phase)
    manifest, problems = manager.find_damage(path)
    if problems:
        raise CheckpointError(f"{flag}: checkpoint {path} is damaged: {damage_report(problems)}. Nothing was "
                              f"loaded. Name an intact checkpoint, e.g. an earlier step of {path.parent} "
                              f"(`longctx checkpoint verify PATH` checks one).")
    state = {"model": get_model_state_dict(model)}
    check_weights_fit(path, state["model"], "start from a checkpoint of the configured model")
    with _single_process(rt.world == 1):
        read_counted(state, path, process_group=manager.group, no_dist=rt.world == 1)
    set_model_state_dict(model, state["model"])
    model.init_rope()
    return manifest


def load_model_weights(path: Path, model) -> dict:
    """Only the model weights of a checkpoint, into a single-process model (export, generate). Its two reads of
    the files (an 8B model's: minutes each) run as progress phases, each counting the MB read."""
    with phase(f"checkpoint: verifying the checksums of {path}", done_line=False) as progress:
        manifest = verify(path, checksums=True, progress=progress)
    state = {"model": model.state_dict()}
    # (the model is built from the checkpoint's own config: tensors beyond it mean a config that does not describe them)
    check_weights_fit(path, state["model"], "use the longctx version that wrote it")
    with _single_process(True):
        read_counted(state, path, no_dist=True)
    model.load_state_dict(state["model"])
    return manifest
