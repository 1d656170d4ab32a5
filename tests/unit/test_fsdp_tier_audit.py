"""Audit of parallel/fsdp and the host tier's AdamW (step/host_optimizer.py) on one process.

- parallel.zero_pp_block under qgz alone was not checked: 0 failed as a ZeroDivisionError in the
  metrics' byte counts, a negative block as a reshape error inside the first backward's reduce-scatter
  on every rank, and a block longer than the smallest unit's shard (refused under qwz) padded every
  reduce-scatter row to whole blocks. Now refused before any work, as under qwz.
- HostOptimizer against torch's foreach AdamW, the device tier's CPU reference, through the trainer's
  own calls (clip_step_gradients, guarded_step): tied embeddings, two micro-batches per step, a
  schedule that changes lr every step, clipping that bites, and a skipped (non-finite) step that must
  leave weights, moments and step counts as they were.
- The int8 blocks at their edges (a shard shorter than a block, a last partial block, all-zero and
  huge blocks, non-finite values) against a hand-written per-block reference."""

from types import SimpleNamespace

import pytest
import torch

from longctx.config import load_config
from longctx.errors import ConfigError
from longctx.models.llama import Llama
from longctx.parallel.fsdp.quantized import dequantize_blocks, quantize_blocks
from longctx.parallel.fsdp.shard import quantized_reduce
from longctx.step.gradients import clip_step_gradients
from longctx.step.host_optimizer import HostOptimizer, forward_units
from longctx.step.optimizer import guarded_step

DIMS = SimpleNamespace(world_size=4, dp_replicate=1, expert=1)


def _qgz(block: int):
    cfg = load_config("configs/debug.toml", ["--parallel.zero_pp=qgz", "--parallel.ranks_per_node=2"])
    cfg.parallel.zero_pp_block = block  # (past load's rules, which refuse a block under 1 first: rules_ranges.py)
    return cfg


@pytest.mark.parametrize("block", [0, -2])
def test_qgz_refuses_a_block_under_one_element_before_any_work(block):
    # (before the node mesh is built: no process group is needed to hear it)
    with pytest.raises(ConfigError, match=rf"parallel.zero_pp_block = {block} elements .* use at least 1"):
        quantized_reduce(_qgz(block), DIMS, "cpu")
    with pytest.raises(ConfigError, match=rf"parallel.zero_pp_block = {block} elements .* use 1 \.\. 410"):
        quantized_reduce(_qgz(block), DIMS, "cpu", units=[torch.nn.Linear(40, 40), torch.nn.Linear(4, 4)])


def test_qgz_refuses_a_block_longer_than_the_smallest_shard_as_qwz_does():
    units = [torch.nn.Linear(40, 40), torch.nn.Linear(40, 40), torch.nn.Linear(4, 4)]  # the last: the root
    with pytest.raises(ConfigError, match=r"smallest FSDP unit's shard \(410 elements per rank\)"):
        quantized_reduce(_qgz(512), DIMS, "cpu", units=units)


# --- HostOptimizer against the device tier's AdamW -----------------------------------------------------

CFG = load_config(None, {"model": {"preset": "debug", "dim": 16, "layers": 2, "heads": 2, "kv_heads": 1,
                                   "ffn_dim": 32, "vocab_size": 64, "tie_embeddings": True}})


def _groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _micro_batch(model, seed):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model(tokens, None, None, labels=tokens, loss_reduction="sum") / 64


def _train(model, opt, skip: int, steps: int = 5) -> list[torch.Tensor]:
    norms = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 0.02 / (step + 1)
        for micro in range(2):
            loss = _micro_batch(model, 10 * step + micro)
            (loss * float("nan") if step == skip else loss).backward()
        norm = clip_step_gradients(model, opt, 0.05)
        guarded_step(opt, torch.isfinite(norm))
        opt.zero_grad(set_to_none=True)
        norms.append(norm)
    if hasattr(opt, "finish_update"):
        opt.finish_update()
    return norms


def test_host_adamw_steps_as_the_device_adamw_with_tied_embeddings_accumulation_and_a_skipped_step():
    ref, host = Llama(CFG.model), Llama(CFG.model)
    ref.init_weights(0)
    host.init_weights(0)
    assert host.output is None  # (tied: the embedding is the head)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.02, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    host_opt = HostOptimizer(_groups(host), forward_units(host), lr=0.02, betas=(0.9, 0.95), eps=1e-8)
    ref_norms, host_norms = _train(ref, ref_opt, skip=2), _train(host, host_opt, skip=2)
    assert not torch.isfinite(ref_norms[2]) and not torch.isfinite(host_norms[2])
    finite = [i for i in range(5) if i != 2]
    norms = [torch.stack([n[i] for i in finite]) for n in (host_norms, ref_norms)]
    torch.testing.assert_close(*norms)
    assert max(n.item() for n in ref_norms if torch.isfinite(n)) > 0.05  # (the clipping bites)
    for a, b in zip(ref.parameters(), host.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # fused vs foreach kernels
    ref_state, host_state = ref_opt.state_dict()["state"], host_opt.state_dict()["state"]
    for i in ref_state:  # four steps counted, the skipped one not
        assert int(ref_state[i]["step"]) == int(host_state[i]["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(host_state[i][key], ref_state[i][key], rtol=1e-5, atol=1e-9)
    assert all(torch.equal(p, m) for p, m in zip(host_opt.params, host_opt.masters))  # the device copy refreshed


# --- qwZ / qgZ's int8 blocks at their edges --------------------------------------------------------------

def _reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each block of `block` elements (the last may be shorter) rounded to 255 levels of its largest magnitude."""
    out = []
    for piece in x.float().split(block):
        top = piece.abs().max()
        out.append(piece if top == 0 else torch.round(piece / (top / 127)) * (top / 127))
    return torch.cat(out)


@pytest.mark.parametrize("n,block", [(5, 8), (17, 8), (16, 8), (1, 1), (3, 512)])
def test_blocks_at_their_edges_round_as_the_per_block_reference(n, block):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[: min(n, block) // 2] = 0.0  # (a block with zeros, and with n >= 2 blocks an all-zero one)
    q, scale = quantize_blocks(x, block)
    got = dequantize_blocks(q, scale, n, torch.float32)
    torch.testing.assert_close(got, _reference(x, block), rtol=1e-6, atol=1e-7)


def test_all_zero_huge_and_non_finite_blocks():
    huge = torch.tensor([3.0e38, -1.0e38, 1.0, 0.0])
    x = torch.cat([torch.zeros(4), huge, torch.tensor([1.0, float("inf"), 2.0, 3.0]),
                   torch.tensor([float("nan"), 1.0, 2.0, 3.0])])
    q, scale = quantize_blocks(x, 4)
    got = dequantize_blocks(q, scale, x.numel(), torch.float32)
    assert torch.equal(got[:4], torch.zeros(4))  # scale 0: zeros, not NaN
    assert torch.isfinite(got[4:8]).all() and abs(got[4].item() - 3.0e38) <= 3.0e38 / 254
    # a non-finite value keeps its whole block non-finite: the step guard must still see it
    assert not torch.isfinite(got[8:12]).any() and not torch.isfinite(got[12:]).any()
