"""Shared worker of the resume audits of the data-parallel variants (tests/distributed/test_resume_pp_audit_*.py):
a tiny fp32 run through the library path (train()), the layout-free state of a checkpoint read back as one full
state dict (DCP's own reader, no layout involved), the state a resumed Trainer holds right after its load (full
tensors gathered over its ranks), and their comparison key by key, AdamW's exp_avg, exp_avg_sq and step included."""

from __future__ import annotations

from pathlib import Path

import torch

from longctx.config import load_config

BASE = ["--model.layers=2", "--train.seq_len=128", "--train.global_batch=4", "--train.steps=6",
        "--train.warmup_steps=2", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=200", "--checkpoint.interval=3", "--checkpoint.keep=3"]
SAVED = "checkpoints/step-00000003"
LAST = "checkpoints/step-00000006"


def config(args, run_dir: str, base=None):
    return load_config("configs/debug.toml", [*(BASE if base is None else base), *args, f"--train.run_dir={run_dir}"])


def trained(args, run_dir: str) -> tuple[int, list[float]]:
    """(first step, losses) of a run of BASE + args in run_dir (a resume when args name one)."""
    from longctx.train.trainer import train

    res = train(config(args, run_dir), log=lambda *a, **k: None)
    return res.first_step, res.losses


def loaded(args, run_dir: str, base=None) -> dict | None:
    """The full state (model and optimizer, gathered over the ranks) of a Trainer of base (BASE) + args right after its
    set-up resumed a checkpoint, before any step: what the load restored, whatever the tier keeps it in. Under
    memory.model_states = host_optimizer the moments its step reads are the inner AdamWs' (step/host_optimizer.py):
    each must be the very tensor the optimizer's state (what DCP saves) holds. On rank 0; None elsewhere."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from longctx.step.host_optimizer import HostOptimizer
    from longctx.train.trainer import Trainer

    trainer = Trainer(config(args, run_dir, base), log=lambda *a, **k: None)
    opt = trainer.optimizer
    if isinstance(opt, HostOptimizer):
        for i, p in enumerate(opt.params):
            inner, outer = opt._inner_state(i)[opt.masters[i]], opt.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                mine = outer[k].to_local() if hasattr(outer[k], "to_local") else outer[k]
                assert mine.data_ptr() == inner[k].data_ptr(), (i, k)  # the step updates what a save writes
            assert outer["step"] is inner["step"]
    model_sd, optim_sd = get_state_dict(trainer.model, opt,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return {"model": model_sd, "optim": optim_sd} if rank == 0 else None


def full_state(ckpt: Path, out: Path) -> dict:
    """A checkpoint's layout-free state as one state dict (DCP's reader; no layout of ours involved)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def flat(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            yield from flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], d


def state_tensors(state: dict) -> dict:
    """{name: tensor} of the weights and of AdamW's state (param_groups' hyper-parameters are the run's config's,
    docs/checkpoints.md), with a check that every part of AdamW's state is there."""
    out = {k: v for k, v in flat(state) if k.startswith("model.") or k.startswith("optim.state.")}
    for part in ("exp_avg", "exp_avg_sq", "step"):
        assert any(k.startswith("optim.state.") and k.endswith(f".{part}") for k in out), part
    return out


def worst_difference(x: dict, y: dict) -> float:
    """The largest |difference| over every weight and AdamW state tensor; the two must hold the same names."""
    fx, fy = state_tensors(x), state_tensors(y)
    assert fx.keys() == fy.keys(), sorted(fx.keys() ^ fy.keys())[:10]
    worst = 0.0
    for k, a in fx.items():
        b = fy[k]
        a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
        assert a.shape == b.shape, k
        worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
    return worst


def jobs(root: Path, layouts: dict, names, resumes, loads) -> list:
    """run_spawned_many's jobs: the uninterrupted run of each of `names`, B resumed from A's step 3 for each
    (A, B) of `resumes` (key "A>B"), and B's Trainer loading it for each of `loads` (key "load A>B")."""
    out = [(name, trained, (layouts[name], str(root / name))) for name in names]
    for a, b in resumes:
        out.append((f"{a}>{b}", trained, ([*layouts[b], f"--checkpoint.resume={root / a / SAVED}"],
                                          str(root / f"{a}-to-{b}"))))
    for a, b in loads:
        out.append((f"load {a}>{b}", loaded, ([*layouts[b], f"--checkpoint.resume={root / a / SAVED}"],
                                              str(root / f"load-{a}-to-{b}"))))
    return out


def compare(root: Path, out: dict, a: str, b: str, tmp: Path) -> tuple[float, float, float, float]:
    """B resumed from A's step 3 against B's uninterrupted run: (max |loss diff| over steps 4-6, max |diff| of
    the step-6 weights and AdamW state; the same two for A's own uninterrupted run against B's: the modes' own
    difference, which the resume may not exceed by more than rounding)."""
    first, losses = out[f"{a}>{b}"][0]
    assert first == 4 and len(losses) == 3
    loss = max(abs(x - y) for x, y in zip(losses, out[b][0][1][3:]))
    own_loss = max(abs(x - y) for x, y in zip(out[a][0][1], out[b][0][1]))
    ref = full_state(root / b / LAST, tmp / "b.pt")
    state = worst_difference(full_state(root / f"{a}-to-{b}" / LAST, tmp / "mine.pt"), ref)
    own = worst_difference(full_state(root / a / LAST, tmp / "a.pt"), ref)
    print(f"{a} -> {b}: losses {loss:.2e} (A's own run against B's: {own_loss:.2e}), weights and AdamW state "
          f"{state:.2e} (A's own: {own:.2e})")
    return loss, state, own_loss, own


def check_loaded(root: Path, out: dict, a: str, b: str, tmp: Path) -> None:
    """The state B's Trainer holds after loading A's step 3 is that checkpoint's, to the bit."""
    mine = out[f"load {a}>{b}"]
    assert all(x is None for x in mine[1:])
    diff = worst_difference(mine[0], full_state(root / a / SAVED, tmp / "saved.pt"))
    print(f"loaded {a} -> {b}: max |diff| {diff:.2e}")
    assert diff == 0.0
