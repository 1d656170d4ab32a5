"""A sync run resumed from a co2 run's checkpoint goes on from replica 0's weights and AdamW moments (the
layout-free part): the other replicas' progress since their last merge and CO2's outer state (momentum, a
change in flight), which sit in each rank's local-rank{r}.pt, are left behind. docs/parallelism.md said
so; the run said nothing. It says it now, once, and nothing for a checkpoint without CO2 state."""

from pathlib import Path
from types import SimpleNamespace

from longctx.config import load_config
from longctx.train.co2 import co2_rounds


def _said(tmp_path: Path, with_co2_state: bool) -> list[str]:
    saved = tmp_path / "step-00000003"
    saved.mkdir()
    if with_co2_state:
        (saved / "local-rank0.pt").write_bytes(b"")
    ckpt = SimpleNamespace(resumed_from=(saved, {}), rank=0)
    lines: list[str] = []
    cfg = load_config("configs/debug.toml", [])  # train.data_parallel = sync
    assert co2_rounds(cfg, None, None, None, ckpt, lines.append) is None
    return lines


def test_a_sync_resume_of_a_co2_checkpoint_says_what_it_leaves_behind(tmp_path):
    (line,) = _said(tmp_path, with_co2_state=True)
    assert "step-00000003" in line and "replica 0" in line and "momentum" in line
    assert "--train.data_parallel co2" in line


def test_a_sync_resume_of_a_sync_checkpoint_says_nothing(tmp_path):
    assert _said(tmp_path, with_co2_state=False) == []
