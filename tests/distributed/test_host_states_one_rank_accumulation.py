"""memory.model_states = host at world 1 is a one-rank FSDP job: with train.grad_accum > 1 and the
default memory.grad_sync = step, FSDP's deferred reduction kept the whole model's unsharded fp32
gradients on the device between micro-batches (4 bytes per parameter the tier and its accounting,
costs/host_bytes.py device_bytes, say the device never holds: there is nothing to reduce across one
rank). step/gradients.py set_gradient_sync now always reduces a one-rank FSDP group, so each
micro-batch's gradients go to host memory (the offloaded shards' .grad) as the docs describe,
with the same values as the device tier's gradients."""

import pytest

from longctx.config import load_config
from longctx.job.spawn import run_spawned_many

ARGS = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300",
        "--train.seq_len=256", "--train.grad_accum=2", "--train.global_batch=4"]


def _grads_by_micro_batch(run_dir):
    """For micro-batch 1 (sync off, as the trainer sets it) and micro-batch 2 (sync on): (the `host`
    tier's gradients that are None, the largest difference from the device tier's, the largest
    device gradient); and the bytes of unsharded gradients FSDP held after micro-batch 1."""
    import torch
    from torch.distributed.tensor import DTensor

    from longctx.step.gradients import set_gradient_sync
    from longctx.train.trainer import Trainer

    full = lambda t: None if t is None else (t.full_tensor() if isinstance(t, DTensor) else t).clone()  # noqa: E731
    seen, held = {}, 0
    for tier in ("device", "host"):
        cfg = load_config("configs/debug.toml", [*ARGS, f"--memory.model_states={tier}",
                                                 f"--train.run_dir={run_dir}-{tier}"])
        model = Trainer(cfg, log=lambda *a, **k: None).model
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, cfg.model.vocab_size, (1, 64), generator=g) for _ in range(2)]
        seen[tier] = []
        for i, tokens in enumerate(batches):
            set_gradient_sync(model, i == len(batches) - 1)
            model(tokens, None, None, labels=tokens, loss_reduction="sum").backward()
            seen[tier].append([full(p.grad) for p in model.parameters()])
            if tier == "host" and i == 0:  # FSDP's own unsharded gradients, kept while sync is off
                for unit in (m for m in model.modules() if hasattr(m, "_get_fsdp_state")):
                    group = unit._get_fsdp_state()._fsdp_param_group
                    for fp in [] if group is None else group.fsdp_params:
                        acc = getattr(fp, "unsharded_accumulated_grad", None)
                        param = getattr(fp, "_unsharded_param", None)
                        acc = acc if acc is not None else getattr(param, "grad", None)
                        held += 0 if acc is None else acc.numel() * acc.element_size()
    out = []
    for device, host in zip(seen["device"], seen["host"]):
        assert len(device) == len(host) > 0 and all(a is not None for a in device)
        missing = sum(b is None for b in host)
        diff = max(((a - b).abs().max().item() for a, b in zip(device, host) if b is not None), default=float("inf"))
        out.append((missing, diff, max(a.abs().max().item() for a in device)))
    return out, held


@pytest.fixture(scope="module")
def grads(tmp_path_factory):
    base = tmp_path_factory.mktemp("one-rank-sync")
    (result,) = run_spawned_many(1, [("grads", _grads_by_micro_batch, (f"{base}/run",))])["grads"]
    return result


def test_host_tier_at_world_1_holds_no_unsharded_gradients_between_micro_batches(grads):
    per_micro_batch, held = grads
    assert held == 0
    assert per_micro_batch[0][0] == 0  # every gradient in host memory (the offloaded shards' .grad) already


@pytest.mark.parametrize("micro_batch", [0, 1])
def test_host_tier_gradients_equal_the_device_tiers_after_each_micro_batch(grads, micro_batch):
    missing, diff, largest = grads[0][micro_batch]
    assert missing == 0 and largest > 0
    assert diff <= 1e-6 * largest


def test_the_accounting_has_no_device_gradients_for_host_at_world_1():
    from longctx.costs.host_bytes import device_bytes
    from longctx.costs.shape import MeshShape

    m = load_config("configs/debug.toml", ARGS).model
    parts = device_bytes(m, MeshShape(), "host", "step", 2, 4, 0.0, 0.0)
    assert "accumulated_grads" not in parts and parts["model_states"] == 0
