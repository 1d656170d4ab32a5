"""A checkpoint's load counts its reads (loadprog113). Before, DCP's read of the weights (`model.init_from`, eval,
export, generate) and of a resume's states was a phase with no count ("checkpoint: reading DIR [2m]"), and
init_from's checksums, split among the ranks, had none either; each now counts this rank's MB of a total known
up front. The count must not change what is read: the state loaded through the counting reader equals a plain
dcp.load's bit for bit, in the same tensors. And `longctx checkpoint export` read the chat template twice (once
to check it, once more from the copy); it reads it once.

Each count is watched through a Phase that records every value its count takes (no timing is asserted)."""

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from longctx import progress
from longctx.checkpoint.manager import CheckpointManager
from longctx.checkpoint.weights_only import load_model_weights, load_weights_into
from longctx.config import load_config, to_dict
from longctx.job.spawn import run_spawned
from longctx.models.llama import build_model
from phase_spy import RecordedPhase, record_phases

TINY = ["--model.dim=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2", "--model.vocab_size=64",
        "--model.ffn_dim=48", "--train.seq_len=16", "--train.global_batch=2"]
LAYOUT = {"world": 1, "dp_replicate": 1, "dp_shard": 1, "head": 1, "ctx": 1, "window": 0,
          "placement": "head-first", "expert": 1}


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "20")  # (lines on: rank 0 speaks; the work takes far less)
    monkeypatch.delenv("RANK", raising=False)
    return record_phases(monkeypatch.setattr)


def _phase(made, start: str) -> RecordedPhase:
    found = [p for p in made if p.what.startswith(start)]
    assert len(found) == 1, [p.what for p in made]
    return found[0]


def _quiet(*_a, **_k):
    pass


def _cfg():
    return load_config(overrides=TINY)


def _saved(tmp_path) -> tuple[Path, object]:
    """A step-1 checkpoint written by the repo's own save path (model and AdamW moments), and its config."""
    cfg = _cfg()
    model = build_model(cfg.model, seed=3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (1, 8))).float().pow(2).mean().backward()
    optimizer.step()  # (moments to read back)
    manager = CheckpointManager(tmp_path / "ck", keep=0, async_save=False, rank=0, world=1, layout=LAYOUT,
                                model_cfg=to_dict(cfg)["model"], log=_quiet)
    manager.save(1, model, optimizer, {"epoch": 0})
    manager.wait()
    return tmp_path / "ck" / "step-00000001", cfg


def _shard_bytes(step: Path) -> int:
    return sum(p.stat().st_size for p in step.glob("__*.distcp"))


def _tensor_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def _counted_up_to_the_total(p: RecordedPhase) -> None:
    assert p.total and p.unit == "MB", (p.what, p.total, p.unit)
    counts = p.values
    assert all(a <= b for a, b in zip(counts, counts[1:])), counts  # only up
    assert counts[-1] == p.total, (counts[-1], p.total)  # ends at the total
    assert len(set(counts)) > 3, counts  # moves inside the read, tensor by tensor


# -- 1. the reads count their MB ----------------------------------------------------------------------------


def test_a_resumes_read_counts_this_ranks_mb_up_to_the_whole_read(tmp_path, spy):
    from longctx.job.runtime import Runtime
    from longctx.train.setup import open_checkpointing

    step, _ = _saved(tmp_path)
    run = load_config(overrides=[*TINY, f"--checkpoint.resume={step}", f"--checkpoint.dir={tmp_path / 'ck'}"])
    model = build_model(run.model, seed=9)
    sampler = SimpleNamespace(load_state_dict=lambda state: None)
    _, resumed = open_checkpointing(run, tmp_path / "run", Runtime.create(run, 0, 1, "cpu"), model,
                                    torch.optim.AdamW(model.parameters()), sampler, _quiet)
    assert resumed == 1
    read = _phase(spy, "checkpoint: reading")
    _counted_up_to_the_total(read)
    # a resume reads every stored item (model and optimizer) once: the shard files, all but their framing if any
    assert 0.99 * _shard_bytes(step) / 1e6 < read.total <= _shard_bytes(step) / 1e6, (read.total, _shard_bytes(step))


def test_the_weights_reads_count_their_mb_the_model_s_share_of_the_files(tmp_path, spy):
    step, cfg = _saved(tmp_path)
    model = build_model(cfg.model, seed=9)
    load_weights_into(step, model, SimpleNamespace(rank=0, world=1), log=_quiet)  # (model.init_from, eval)
    load_model_weights(step, build_model(cfg.model, seed=9))  # (export, generate)
    reads = [p for p in spy if p.what.startswith("checkpoint: reading")]
    assert len(reads) == 2, [p.what for p in spy]
    for read in reads:
        _counted_up_to_the_total(read)
        # the model's tensors, with their files' framing, and not the optimizer's moments beside them
        assert _tensor_bytes(model.state_dict()) / 1e6 < read.total < _shard_bytes(step) / 2e6, read.total


# -- 2. the same state, in the same tensors -----------------------------------------------------------------


def _fresh_state(cfg) -> dict:
    """A resume's state to load into (get_state_dict: the model's and AdamW's, its moments allocated)."""
    model = build_model(cfg.model, seed=9)
    model_sd, optim_sd = get_state_dict(model, torch.optim.AdamW(model.parameters()))
    return {"model": model_sd, "optim": optim_sd}


def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _bits(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape), value.detach().reshape(-1).view(torch.uint8).tolist()
    return value


def test_the_counted_read_loads_the_plain_reads_state_bit_for_bit_in_place(tmp_path, spy):
    from longctx.checkpoint.counted_read import CountingReader

    step, cfg = _saved(tmp_path)
    plain, counted = _fresh_state(cfg), _fresh_state(cfg)
    places = {path: t.data_ptr() for path, t in _leaves(counted) if isinstance(t, torch.Tensor)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(plain, checkpoint_id=str(step), no_dist=True)
        with progress.phase("checkpoint: reading", done_line=False) as read:
            dcp.load(counted, storage_reader=CountingReader(step, read), no_dist=True)
    _counted_up_to_the_total(read)
    mine, theirs = list(_leaves(counted)), list(_leaves(plain))
    assert [p for p, _ in mine] == [p for p, _ in theirs]
    assert sum(isinstance(v, torch.Tensor) and v.abs().sum() > 0 for _, v in theirs) > 10  # (moments read too)
    for (path, a), (_, b) in zip(mine, theirs):
        assert _bits(a) == _bits(b), path
    # DCP reads into the state's own tensors, and the counted read still does: no copy of the state beside them
    assert {path: t.data_ptr() for path, t in mine if isinstance(t, torch.Tensor)} == places
    # and a resume through the manager (the path training takes) ends with the same weights
    model = build_model(cfg.model, seed=9)
    manager = CheckpointManager(tmp_path / "ck", keep=0, async_save=False, rank=0, world=1, layout=LAYOUT,
                                model_cfg=to_dict(cfg)["model"], log=_quiet)
    manager.load(step, model, torch.optim.AdamW(model.parameters()))
    for k, v in model.state_dict().items():
        assert _bits(v) == _bits(plain["model"][k]), k


# -- 3. init_from's checksums count this rank's share ------------------------------------------------------


def test_init_froms_checksums_count_the_mb_of_the_whole_checkpoint_on_one_rank(tmp_path, spy):
    step, cfg = _saved(tmp_path)
    load_weights_into(step, build_model(cfg.model, seed=9), SimpleNamespace(rank=0, world=1), log=_quiet)
    checksums = _phase(spy, "checkpoint: verifying the checksums")
    whole = sum(p.stat().st_size for p in step.iterdir() if p.name != "manifest.json") / 1e6
    assert checksums.total == pytest.approx(whole, rel=1e-12) and checksums.unit == "MB", (checksums.total, whole)
    assert checksums.values[-1] == pytest.approx(whole, rel=1e-9), checksums.values
    assert all(a <= b for a, b in zip(checksums.values, checksums.values[1:])), checksums.values
    assert "share" not in checksums.what, checksums.what  # (one rank: the whole)


def _checksums_on_rank(step: str, overrides: list[str]):
    import longctx.progress as progress_module

    made = record_phases()
    progress_module.speaks = lambda: True  # (rank 1's count too, to add up)
    model = build_model(load_config(overrides=overrides).model, seed=9)
    import torch.distributed as dist

    load_weights_into(Path(step), model, SimpleNamespace(rank=dist.get_rank(), world=2), log=_quiet)
    p = _phase(made, "checkpoint: verifying the checksums")
    return p.what, p.total, p.values


def test_init_froms_checksums_on_two_ranks_count_each_ranks_share_and_say_so(tmp_path):
    step, _ = _saved(tmp_path)
    said = run_spawned(2, _checksums_on_rank, str(step), TINY)
    whole = sum(p.stat().st_size for p in step.iterdir() if p.name != "manifest.json") / 1e6
    for what, total, history in said:
        assert what.endswith("(this rank's share)"), what
        assert 0 < total < whole, (total, whole)
        assert history[-1] == pytest.approx(total, rel=1e-9), (history, total)
    assert sum(total for _, total, _ in said) == pytest.approx(whole, rel=1e-12), (said, whole)


# -- 4. export reads the chat template once -----------------------------------------------------------------


def test_export_reads_the_chat_template_once_and_still_writes_its_stops(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import json

    from test_export_audit import checkpoint
    from test_generate_chat import IM_END, _chat_tokenizer

    from longctx.checkpoint import export

    tok = tmp_path / "tok"
    tok.mkdir()
    _chat_tokenizer(tok)
    step = checkpoint(tmp_path, str(tok / "tokenizer.json"))
    reads, real = [], export.load_chat_template

    def counted(*args, **kwargs):
        reads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "load_chat_template", counted)
    out, _, _, _ = export.export_hf(step, tmp_path / "out")
    assert len(reads) == 1, reads
    # as before: the end of turn first, then the end of document (the tokenizer's <|endoftext|>, id 0)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [IM_END, 0]


def test_a_resumes_checksums_count_their_mb_in_a_phase(tmp_path, spy):
    """A resume's verification (resume_point: --checkpoint.resume auto or PATH) and a rollback's ran find_damage
    with no phase at all: an 8B model's checksums were minutes with no line. Now find_damage holds its own phase,
    counting this rank's MB, when its caller gives none."""
    path, cfg = _saved(tmp_path)
    manager = CheckpointManager(path.parent, keep=0, async_save=False, rank=0, world=1, layout=LAYOUT,
                                model_cfg=to_dict(cfg)["model"], log=_quiet, create=False)
    found = manager.resume_point("auto")
    assert found is not None and found[0] == path
    checks = _phase(spy, "checkpoint: verifying the checksums of")
    files = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "manifest.json")
    assert checks.unit == "MB" and checks.total == pytest.approx(files / 1e6, rel=0.05), (checks.total, files)
    assert checks.values == sorted(checks.values) and checks.values[-1] == pytest.approx(checks.total)
