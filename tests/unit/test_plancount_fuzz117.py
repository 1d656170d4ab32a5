"""A randomized audit of the memory counts the planner and `longctx check` rely on, against what a real run on CPU
holds (one process; the sharded layouts: tests/distributed/test_plancount_fuzz117_ranks.py).

Each case draws a tiny model (dense or MoE; grouped-query heads; tied or untied embeddings; q/k norms per head or
over the whole projection; shared experts with or without a gate; widths that divide nothing) and a memory policy
(recompute none / full / selective; an offload fraction; block, loss, attention and expert chunks), builds it as
training does (train/model.py build_llama_training) and counts, independently of the accounting code
(tests/plancount_fuzz117_count.py):

- activations: the storages autograd's saved-tensor hooks are handed in one forward (and the MoE router records),
  by storage, device and host tier, at two lengths, against memory/accounting.py estimate_activations. The count
  is documented as exact ("measurement can check it to the byte"): it must agree within the loss's few scalars
  (SCALARS bytes) at both lengths, and its error must not grow with the length (every per-token term exact). The
  one documented approximation: selective + a fraction A stores round(A x tokens) tokens of each offloaded block
  where the count takes A x tokens: within half a token's stored bytes per block (memory/host_parts.py, whose
  part list is exact for a dense model, is held to the byte). And nothing kept grows as S x S.
- model states of one process, after an optimizer step: the storages of the parameters (a tied table once), their
  gradients and AdamW's moments, against costs/model_states.py predicted_model_state_bytes and costs/host_bytes.py
  device_state_bytes / host_state_bytes per tier (device; host_optimizer: weights on the device, fp32 masters,
  gradient buffers and moments on the host, and the device gradients' peak during backward within the documented
  gradients_on_device + head_grad_bytes).
"""

import dataclasses

import pytest
import torch

from longctx.costs.host_bytes import device_state_bytes, head_grad_bytes, host_state_bytes
from longctx.costs.model_states import param_counts, predicted_model_state_bytes
from longctx.costs.shape import MeshShape
from longctx.job.runtime import Runtime
from longctx.memory.accounting import estimate_activations
from longctx.memory.host_parts import offloaded_block_parts
from longctx.memory.policy import MemoryPolicy
from longctx.planner.validate_ranks import random_batch, train_step
from longctx.step.optimizer import make_optimizer
from longctx.train.model import build_llama_training
from plancount_fuzz117_count import _storage, config, draw_model, draw_policy, saved_bytes, state_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (48, 96)
SCALARS = 32  # bytes of 0-d tensors the loss keeps (its valid-token count and the like), not counted per token
SEEDS = list(range(30))
SLOW_SEEDS = list(range(30, 100))
AUTOCAST_SEEDS = list(range(12))
SLOW_AUTOCAST_SEEDS = list(range(12, 60))


def _quiet(*_a, **_k):
    pass


def _built(cfg):
    rt = Runtime.create(cfg, 0, 1, "cpu")
    return rt, build_llama_training(cfg, torch.device("cpu"), rt, log=_quiet)


def _activation_case(seed: int, model_keys: dict | None = None, memory: dict | None = None,
                     bf16: bool = False) -> tuple:
    """(config, {length: (device bytes, host bytes, the estimate)}) of a draw; `bf16`: the step under bf16 autocast
    over fp32 weights (one CPU process: memory/accounting.py activation_dtype's e = 4 with `autocast`)."""
    keys = model_keys or draw_model(seed)
    cfg = config(keys, memory if memory is not None else draw_policy(seed, keys["preset"] == "debug-moe"),
                 dtype="bf16" if bf16 else "fp32")
    out = {}
    for n in LENGTHS:
        _, model = _built(cfg)
        tokens = torch.randint(0, cfg.model.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
        device, host, _ = saved_bytes(model, tokens, tokens.clone(), bf16)
        est = estimate_activations(cfg.model, n, 1, policy=MemoryPolicy.from_config(cfg.memory), dtype_bytes=4,
                                   autocast=bf16)
        out[n] = (device, host, est)
    return cfg, out


def _host_rounding(cfg, n: int) -> float:
    """The documented slack of the host count: half a token's stored bytes of every offloaded block (selective + a
    fraction strictly between 0 and 1: round(A x tokens) tokens stored, counted as A x tokens); 0 elsewhere."""
    policy = MemoryPolicy.from_config(cfg.memory)
    if policy.recompute != "selective" or not 0 < policy.offload_fraction < 1:
        return 0.0
    at = {a: estimate_activations(cfg.model, n, 1, policy=dataclasses.replace(policy, offload_fraction=a),
                                  dtype_bytes=4, autocast=cfg.train.dtype == "bf16").total_host for a in (1.0, 1e-9)}
    return 0.5 * (at[1.0] - at[1e-9]) / n


def _check_activations(seed: int, cfg, out: dict) -> None:
    what = f"seed {seed}: model {cfg.model.family} moe={cfg.model.is_moe} memory {cfg.memory}"
    err = {n: (device - est.total_device, host - est.total_host) for n, (device, host, est) in out.items()}
    for n, (device_err, host_err) in err.items():
        assert abs(device_err) <= SCALARS, f"{what}: {n} tokens, device {out[n][0]} B held, counted {out[n][2]}"
        assert abs(host_err) <= SCALARS + _host_rounding(cfg, n), \
            f"{what}: {n} tokens, host {out[n][1]} B held, counted {out[n][2].total_host}"
    short, long_ = LENGTHS
    # full + a fraction cuts the block input at round(A x elements): half an element a block either way
    split = 4 * cfg.model.layers if cfg.memory.recompute == "full" and 0 < cfg.memory.offload_fraction < 1 else 0
    growth = err[long_][0] - err[short][0]
    assert abs(growth) <= 8 + split, f"{what}: the device count's error grows with the length: {err}"
    # (the stored tokens' rounding: up to half a token at the longer length, and twice half at the shorter)
    total = {n: out[n][0] + out[n][1] for n in LENGTHS}
    slack = 2 * SCALARS + 3 * _host_rounding(cfg, long_)
    assert total[long_] <= long_ / short * total[short] + slack, f"{what}: more than linear in S: {total}"


def _check_dense_host_parts(cfg, out: dict) -> None:
    """A dense model's offloaded blocks, part by part (host_parts, the pinned figure's input), to the byte."""
    policy = MemoryPolicy.from_config(cfg.memory)
    if cfg.model.is_moe or not policy.offload_fraction:
        return
    blocks = max(0, cfg.model.layers - policy.offload_skip_last)
    for n, (_, host, _) in out.items():
        parts = offloaded_block_parts(cfg.model, n, 1, head=1, ctx=1, policy=policy, p=4,
                                      autocast=cfg.train.dtype == "bf16")
        assert host == blocks * sum(parts), f"{cfg.memory}: {n} tokens, {host} B on the host, parts {parts}"


@pytest.mark.parametrize("seed", SEEDS)
def test_activation_counts_equal_what_autograd_keeps(seed):
    cfg, out = _activation_case(seed)
    _check_activations(seed, cfg, out)
    _check_dense_host_parts(cfg, out)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_activation_counts_equal_what_autograd_keeps_more_draws(seed):
    cfg, out = _activation_case(seed)
    _check_activations(seed, cfg, out)
    _check_dense_host_parts(cfg, out)


@pytest.mark.parametrize("seed", AUTOCAST_SEEDS)
def test_autocast_activation_counts_equal_what_autograd_keeps(seed):
    """bf16 autocast over fp32 weights (a one-process bf16 run), counted by each tensor's dtype with the weight
    copies (docs/memory.md: exact under full, within 0.1% under selective and none): held to the same bytes."""
    cfg, out = _activation_case(seed, bf16=True)
    _check_activations(seed, cfg, out)
    _check_dense_host_parts(cfg, out)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_AUTOCAST_SEEDS)
def test_autocast_activation_counts_more_draws(seed):
    cfg, out = _activation_case(seed, bf16=True)
    _check_activations(seed, cfg, out)
    _check_dense_host_parts(cfg, out)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_plain_loss_under_autocast_keeps_the_head_weight_copy(recompute):
    """The plain (unchunked) loss under autocast: its LM head matmul keeps the bf16 copy of the [vocab, dim]
    weight and the bf16 cast of the final norm's output (one feed), not the norm's fp32 output. Counted as a
    block norm's 8 d + 4 B a token and no copy, the count was 2 d B a token high and 2 vocab dim B low (seed 27's
    model, held less counted: +636 B at 48 tokens, -1668 at 96; for an 8B's 128K x 4K head, 1 GiB of copy left
    out at memory.loss_chunk 0 or with a micro-batch within one loss chunk)."""
    cfg, out = _activation_case(27, memory={"recompute": recompute, "loss_chunk": 0}, bf16=True)
    _check_activations(27, cfg, out)


TOP1 = {"preset": "debug-moe", "dim": 36, "layers": 3, "heads": 3, "kv_heads": 3, "head_dim": 4, "ffn_dim": 44,
        "vocab_size": 37, "moe.experts": 6, "moe.top_k": 1, "moe.expert_dim": 14, "moe.dense_layers": "0",
        "moe.aux_loss": 0.0, "moe.z_loss": 0.0}


@pytest.mark.parametrize("memory", [{"recompute": "none"}, {"recompute": "selective", "offload_fraction": 1.0}])
def test_a_top1_router_keeps_no_renormalisation(memory):
    """At top-1 with moe.norm_topk the routing weight is the constant 1 (models/moe.py Router._weights keeps
    neither the gathered probability nor its sum for backward); memory/moe_counts.py counted 8 B a token for
    them in every MoE layer (at 96 tokens 812 B over, at 48 428: an error that grew with the length)."""
    cfg, out = _activation_case(0, TOP1, memory)
    assert cfg.model.moe_norm_topk
    _check_activations(0, cfg, out)


def _state_case(seed: int, tier: str):
    keys = draw_model(seed)
    cfg = config(keys, {"model_states": tier}, seq_len=24, global_batch=1)
    rt, model = _built(cfg)
    peak = [0]

    def device_grads(_p):  # (registered before the optimizer's: it runs while the gradient is still there)
        held = dict(_storage(q.grad) for q in model.parameters() if q.grad is not None and q.grad.device == q.device)
        peak[0] = max(peak[0], sum(held.values()))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(device_grads)
    opt = make_optimizer(model, cfg)
    train_step(cfg, rt, model, opt, random_batch(cfg), 1.0, zero_grad=False)
    getattr(opt, "finish_update", lambda: None)()
    return cfg, model, opt, peak[0]


@pytest.mark.parametrize("seed", [0, 1, 2, 4, 5])
def test_one_process_device_tier_states_equal_the_tensors(seed):
    cfg, model, opt, _ = _state_case(seed, "device")
    m, shape = cfg.model, MeshShape()
    got = state_bytes(model, opt)
    elements = sum(dict(_storage(p) for p in model.parameters()).values()) // 4  # (a tied table once)
    assert elements == param_counts(m)["total"], cfg.model
    assert got == {"params": 4 * elements, "grads": 4 * elements, "optimizer": 8 * elements}, cfg.model
    assert predicted_model_state_bytes(m, shape) == sum(got.values())
    assert device_state_bytes(m, shape, "device", 4)["model_states"] == sum(got.values())
    assert host_state_bytes(m, shape, "device") == 0


@pytest.mark.parametrize("seed", [3, 4, 8])
def test_one_process_host_optimizer_states_equal_the_tensors(seed):
    cfg, model, opt, peak = _state_case(seed, "host_optimizer")
    m, shape = cfg.model, MeshShape()
    got = state_bytes(model, opt)
    host = (got["optimizer"] + sum(dict(_storage(t) for t in opt.masters).values())
            + sum(dict(_storage(t) for t in opt._grad_buffers).values()))
    assert got["grads"] == 0, "gradients left on the device after the step"
    assert host == host_state_bytes(m, shape, "host_optimizer") == 16 * param_counts(m)["total"], cfg.model
    device = device_state_bytes(m, shape, "host_optimizer", 4)["model_states"]
    # the weights, and at most gradients_on_device's gradients beside them (the untied head's own: head_grad_bytes)
    assert got["params"] == 4 * param_counts(m)["total"]
    assert 0 < peak <= device - got["params"] + head_grad_bytes(m, shape, "host_optimizer"), (peak, cfg.model)
