"""Reshard audit: save at step 3 under layout A, resume under B to step 6; the final checkpoint's weights AND
AdamW state (exp_avg, exp_avg_sq, step) must equal an uninterrupted run under B's (and A's) from the same seed
and data. The states are compared in their layout-free form (DCP's files read back as one full state dict), so
the comparison itself depends on no layout. Tolerance: fp32 reductions in another order (FSDP's reduce-scatter,
head/ctx splits) differ by ~1e-6 relative after 6 AdamW steps; 1e-4 absolute on weights and moments leaves room
for that and none for a lost or permuted state (AdamW's first step alone moves each weight by ~lr = 3e-3)."""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from longctx.config import load_config
from longctx.job.spawn import run_spawned
from longctx.train.trainer import train
from resume_pp_audit import flat  # (a state dict's leaves by dotted key)

BASE = ["--train.steps=6", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=200", "--train.seq_len=128", "--checkpoint.interval=3", "--checkpoint.keep=2"]
MOE = ["--model.preset=debug-moe"]
LAYOUTS = {
    "single": (1, []),
    "dp2": (2, []),
    "head2": (2, ["--parallel.head=2"]),
    "ctx2": (2, ["--parallel.ctx=2"]),
    "host": (2, ["--memory.model_states=host"]),
    "moe-single": (1, MOE),
    "moe-dp2": (2, MOE),
    "moe-ep2": (2, [*MOE, "--parallel.expert=2"]),
    # aux-loss-free balancing: the router's expert_bias buffer changes every step, so it must travel too
    "bias-single": (1, [*MOE, "--model.moe.bias_update_rate=0.01"]),
    "bias-ep2": (2, [*MOE, "--model.moe.bias_update_rate=0.01", "--parallel.expert=2"]),
    "bf16-single": (1, ["--train.dtype=bf16"]),
    "bf16-dp2": (2, ["--train.dtype=bf16"]),
}


def _train(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    res = train(cfg, log=lambda *a, **k: None)
    return res.first_step, res.losses


def run(layout, run_dir, extra=()):
    world, args = LAYOUTS[layout]
    if world == 1:
        return _train([*args, *extra], str(run_dir))
    return run_spawned(world, _train, [*args, *extra], str(run_dir))[0]


def full_state(ckpt: Path, tmp: Path) -> dict:
    out = tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def compare(x: dict, y: dict) -> tuple[list, float]:
    fx, fy = dict(flat(x)), dict(flat(y))
    missing = sorted(set(fx) ^ set(fy))
    for part in ("exp_avg", "exp_avg_sq", "step"):  # AdamW's state is in the comparison, not only the weights
        assert any(k.startswith("optim.state.") and k.endswith(f".{part}") for k in fx), part
    worst = 0.0
    for k in fx.keys() & fy.keys():
        a, b = fx[k], fy[k]
        if torch.is_tensor(a):
            worst = max(worst, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
        elif isinstance(a, float):
            worst = max(worst, abs(a - b))
        elif not k.endswith((".fused", ".foreach")):  # how AdamW computes: the tier's choice (host: fused off)
            assert a == b, k
    return missing, worst


PAIRS = [("single", "dp2"), ("dp2", "single"), ("head2", "ctx2"), ("ctx2", "head2"), ("host", "dp2"),
         ("dp2", "host"), ("moe-ep2", "moe-dp2"), ("moe-dp2", "moe-ep2"), ("moe-single", "moe-ep2"),
         ("bias-ep2", "bias-single"), ("bf16-dp2", "bf16-single")]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    cache = {}

    def get(layout):
        if layout not in cache:
            d = tmp_path_factory.mktemp(f"full-{layout}")
            losses = run(layout, d)[1]
            cache[layout] = (d, losses)
        return cache[layout]
    return get


@pytest.mark.parametrize("a, b", PAIRS)
def test_resume_across_layouts_keeps_weights_and_optimizer(a, b, full, tmp_path):
    dir_a, losses_a = full(a)
    dir_b, losses_b = full(b)
    resumed = tmp_path / "resumed"
    first, losses = run(b, resumed, [f"--checkpoint.resume={dir_a / 'checkpoints' / 'step-00000003'}"])
    assert first == 4 and len(losses) == 3
    loss_diff = max(abs(x - y) for x, y in zip(losses, losses_b[3:]))
    ab = max(abs(x - y) for x, y in zip(losses_a, losses_b))
    mine = full_state(resumed / "checkpoints" / "step-00000006", tmp_path)
    ref = full_state(dir_b / "checkpoints" / "step-00000006", tmp_path)
    missing, worst = compare(mine, ref)
    ab_state = compare(full_state(dir_a / "checkpoints" / "step-00000006", tmp_path), ref)[1]
    print(f"{a} -> {b}: loss diff {loss_diff:.2e} (A vs B uninterrupted {ab:.2e}); state max |diff| {worst:.2e} "
          f"(A vs B uninterrupted {ab_state:.2e})")
    assert not missing, missing[:10]
    # the data position (a global cursor) and the step: the same as the uninterrupted run's after the same steps
    saved = [json.loads((d / "checkpoints" / "step-00000006" / "trainer_state.json").read_text())
             for d in (resumed, dir_b)]
    assert [(t["step"], t["sampler"]) for t in saved] == [(6, saved[1]["sampler"])] * 2
    if a.startswith("bias"):  # the balancing biases moved, so their equality means they were restored
        assert any(v.abs().max() > 0 for k, v in flat(ref) if k.endswith("expert_bias"))
    # fp32: 1e-4; bf16's own layout difference is larger: the resume may add no more than the layouts' difference
    assert loss_diff <= max(1e-4, 2 * ab) and worst <= max(1e-4, 2 * ab_state)


@pytest.mark.parametrize("single, sharded", [("single", "dp2"), ("single", "head2")])  # (debug-moe: llama, no HF MoE)
def test_hf_export_of_a_sharded_checkpoint_equals_the_single_process_one(single, sharded, full, tmp_path):
    from safetensors.torch import load_file

    from longctx.checkpoint.export import export_hf

    tensors = {}
    for layout in (single, sharded):
        export_hf(full(layout)[0] / "checkpoints" / "step-00000006", tmp_path / layout)
        files = sorted((tmp_path / layout).glob("*.safetensors"))
        assert files
        tensors[layout] = {k: v for f in files for k, v in load_file(f).items()}
    a, b = tensors[single], tensors[sharded]
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"export {single} vs {sharded}: {len(a)} tensors, max |diff| {worst:.2e}")
    assert worst <= 1e-4  # the two runs' own fp32 reduction-order difference (the state test's figure)
