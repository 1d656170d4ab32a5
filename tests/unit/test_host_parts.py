"""memory/host_parts.py lists the host allocations of the offloaded activations one by one, as the real
offloader (memory/offload.py) and the attention core's ChunkStore (ops/chunked.py) make them: on CPU the
same code path makes a separate host buffer per part (ops/chunked.py host_copy), logged here for a small
model at a length that is no power of two, under several fractions, policies, block and attention chunks,
batch 2, bf16 and q/k norms. On CUDA each of them is one pinned request, which torch's host allocator locks
rounded up to a power of two: the predicted CUDA figure (costs/host_bytes.py predicted_rank_bytes) is the
sum of the logged sizes so rounded (computed here independently of ops/pinned.py), the CPU figure the
exact bytes, unchanged."""

import math
from collections import Counter, defaultdict

import pytest
import torch

from longctx.config import MemoryConfig, load_config
from longctx.costs.host_bytes import predicted_rank_bytes
from longctx.costs.shape import MeshShape
from longctx.memory import offload
from longctx.memory.accounting import activation_dtype, estimate_activations
from longctx.memory.block_parts import compute_bytes
from longctx.memory.host_parts import core_parts, offloaded_block_parts, pinned_activation_bytes
from longctx.memory.policy import MemoryPolicy
from longctx.models.llama import build_model
from longctx.ops import chunked
from longctx.parallel.parallelize import apply_memory

SEQ = 200  # no power of two, and no chunk divides it
LAYERS = 3


def _locked(n):  # torch's caching host allocator: each pinned request rounded up to a power of two
    return 0 if n == 0 else 2 ** math.ceil(math.log2(n))


def _logged_forward(monkeypatch, memory: MemoryConfig, *, batch=1, bf16=False, overrides=(), autocast=False):
    """(model config, {block: [nbytes of each host allocation its forward made]}) of one real forward;
    `autocast`: fp32 weights, the forward under bf16 autocast as step/loss.py runs it."""
    cfg = load_config(overrides=[f"--model.layers={LAYERS}", *overrides]).model
    model = build_model(cfg, seed=0)
    if bf16:
        model = model.to(torch.bfloat16)
    apply_memory(model, memory, "cpu")
    where = {"block": None}
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda _m, _a, i=i: where.update(block=i))
        block.register_forward_hook(lambda *_a: where.update(block=None))
    log = defaultdict(list)
    real = chunked.host_copy

    def logged(t, stream):
        log[where["block"]].append(t.nbytes)
        return real(t, stream)

    monkeypatch.setattr(offload, "host_copy", logged)
    monkeypatch.setattr(chunked, "host_copy", logged)
    tokens = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
        loss = model(tokens, labels=tokens)
    logged_forward = {k: list(v) for k, v in log.items()}
    loss.backward()
    return cfg, logged_forward


# (recompute, offload fraction, block chunk, attention chunk, attention offload)
CASES = [("full", 0.3, 0, 0, False), ("full", 1.0, 64, 0, False), ("selective", 0.3, 0, 0, False),
         ("selective", 0.7, 64, 0, False), ("selective", 1.0, 0, 0, False), ("selective", 0.45, 48, 96, True),
         ("selective", 0.0, 0, 96, True), ("none", 0.0, 0, 96, True), ("selective", 0.3, 0, 96, False)]


@pytest.mark.parametrize("batch,bf16,overrides", [(1, False, ()), (2, False, ()), (1, True, ()),
                                                  (1, False, ("--model.family=qwen3", "--model.qk_norm=true")),
                                                  (1, True, ("--model.family=qwen3", "--model.qk_norm=true"))])
@pytest.mark.parametrize("recompute,fraction,block_chunk,attention_chunk,attention_offload", CASES)
def test_listed_parts_are_the_allocations_the_offloader_makes(monkeypatch, recompute, fraction, block_chunk,
                                                              attention_chunk, attention_offload, batch, bf16,
                                                              overrides):
    memory = MemoryConfig(recompute=recompute, offload_fraction=fraction, block_chunk=block_chunk, loss_chunk=64,
                          attention_chunk=attention_chunk, attention_offload=attention_offload)
    cfg, logged = _logged_forward(monkeypatch, memory, batch=batch, bf16=bf16, overrides=overrides)
    policy = MemoryPolicy.from_config(memory)
    p = 2 if bf16 else 4
    kw = {"head": 1, "ctx": 1, "policy": policy, "p": p}
    kept = {}  # block -> the host allocations its forward leaves for backward
    for i in range(LAYERS):
        if fraction > 0 and i < LAYERS - policy.offload_skip_last:
            expected = offloaded_block_parts(cfg, SEQ, batch, **kw)
        elif policy.attention_offloaded and recompute != "full":
            expected = core_parts(cfg, SEQ, batch, **kw)
        else:
            expected = []
        # (under full the core's chunks, which its checkpointed forward drops at once, come after the input's)
        kept[i] = logged.get(i, [])[:1] if recompute == "full" else logged.get(i, [])
        assert sorted(kept[i]) == sorted(expected), f"block {i}"
    if not bf16:  # the parts add up to the analytic count (fp32, where estimate_activations is exact)
        est = estimate_activations(cfg, SEQ, batch, policy=policy, dtype_bytes=p)
        assert sum(map(sum, kept.values())) == pytest.approx(est.total_host, abs=p * cfg.dim * LAYERS)
    pinned = pinned_activation_bytes(cfg, SEQ, batch, policy=policy, dtype_bytes=p)
    assert pinned == sum(_locked(n) for v in kept.values() for n in v)


def _kept_host_parts(logged: dict, recompute: str, offloaded_blocks: int) -> list[int]:
    """The logged host allocations that stay until backward: every block's (the kept last one's too: its
    attention core's chunks under attention_offload); under full only each offloaded block's input part."""
    if recompute == "full":
        return [n for i in range(offloaded_blocks) for n in logged[i][:1]]
    return [n for i in range(LAYERS) for n in logged.get(i, [])]


@pytest.mark.parametrize("overrides", [(), ("--model.family=qwen3", "--model.qk_norm=true")])
@pytest.mark.parametrize("recompute,fraction,block_chunk,attention_chunk,attention_offload", CASES)
def test_autocast_parts_are_the_allocations_at_their_dtypes(monkeypatch, recompute, fraction, block_chunk,
                                                            attention_chunk, attention_offload, overrides):
    """One process in bf16 autocast over fp32 weights (activation_dtype (4, True): one GPU off the host tier,
    bf16 on CPU): the offloader's host parts are the fp32 residual stream (block inputs, h, the norms' fp32
    tensors) and the bf16 outputs of the matmuls and the attention kernel. The host figures the preflight, the
    planner and memory.offload_fraction auto read counted every part at 4 B: 1.5x the bytes offloaded here
    (CPU) and up to 2x as pinned (CUDA). Now the listed parts are the allocations, the CPU figure their bytes
    (to one fp32 token row per block: estimate_activations counts A x tokens stored where the offloader stores
    round(A x tokens)) and the CUDA figure their locked sizes."""
    memory = MemoryConfig(recompute=recompute, offload_fraction=fraction, block_chunk=block_chunk, loss_chunk=64,
                          attention_chunk=attention_chunk, attention_offload=attention_offload)
    cfg, logged = _logged_forward(monkeypatch, memory, overrides=overrides, autocast=True)
    policy = MemoryPolicy.from_config(memory)
    e, copies = activation_dtype(True, 1, "device")
    offloaded_blocks = LAYERS - policy.offload_skip_last if fraction > 0 else 0
    for i in range(LAYERS):
        if i < offloaded_blocks:
            expected = offloaded_block_parts(cfg, SEQ, 1, head=1, ctx=1, policy=policy, p=e, autocast=copies)
        elif policy.attention_offloaded and recompute != "full":
            expected = core_parts(cfg, SEQ, 1, head=1, ctx=1, policy=policy, p=compute_bytes(e, copies))
        else:
            expected = []
        got = logged.get(i, [])[:1] if recompute == "full" else logged.get(i, [])
        assert sorted(got) == sorted(expected), f"block {i}"
    offloaded = _kept_host_parts(logged, recompute, offloaded_blocks)
    kw = {"seq_len": SEQ, "micro_batch": 1, "grad_accum": 1, "dtype_bytes": 2}  # (bf16 on one process: autocast)
    _, cpu = predicted_rank_bytes(cfg, MeshShape(), policy, "device", device_type="cpu", **kw)
    _, gpu = predicted_rank_bytes(cfg, MeshShape(), policy, "device", device_type="cuda", **kw)
    assert cpu["activations"] == pytest.approx(sum(offloaded), abs=e * cfg.dim * LAYERS)
    assert gpu["activations"] == sum(_locked(n) for n in offloaded)


@pytest.mark.parametrize("fraction,block_chunk", [(0.3, 0), (0.7, 64)])
def test_a_moe_block_lists_its_other_parts_and_bounds_its_feed_forward(monkeypatch, fraction, block_chunk):
    """A MoE block (debug-moe, OLMoE's q/k norms over the whole projection): every listed part is one the
    offloader makes; the feed-forward's parts, unlisted, are counted at twice their bytes (a bound)."""
    memory = MemoryConfig(recompute="selective", offload_fraction=fraction, block_chunk=block_chunk, loss_chunk=64)
    overrides = ("--model.preset=debug-moe", "--model.family=olmoe", "--model.qk_norm=true",
                 "--model.qk_norm_span=all")
    cfg, logged = _logged_forward(monkeypatch, memory, overrides=overrides)
    policy = MemoryPolicy.from_config(memory)
    listed = offloaded_block_parts(cfg, SEQ, 1, head=1, ctx=1, policy=policy, p=4, mlp=False)
    for i in range(LAYERS - 1):
        assert not Counter(listed) - Counter(logged[i]), f"block {i}"
    pinned = pinned_activation_bytes(cfg, SEQ, 1, policy=policy, dtype_bytes=4)
    assert pinned >= sum(_locked(n) for i in range(LAYERS - 1) for n in logged[i])


@pytest.mark.parametrize("recompute,fraction,block_chunk,attention_chunk,attention_offload", CASES[:6])
def test_cuda_figure_counts_the_offloaded_parts_as_pinned_and_cpu_stays_exact(monkeypatch, recompute, fraction,
                                                                            block_chunk, attention_chunk,
                                                                            attention_offload):
    memory = MemoryConfig(recompute=recompute, offload_fraction=fraction, block_chunk=block_chunk, loss_chunk=64,
                          attention_chunk=attention_chunk, attention_offload=attention_offload)
    cfg, logged = _logged_forward(monkeypatch, memory)
    policy = MemoryPolicy.from_config(memory)
    kw = {"seq_len": SEQ, "micro_batch": 1, "grad_accum": 1, "dtype_bytes": 4}
    _, cpu = predicted_rank_bytes(cfg, MeshShape(), policy, "device", device_type="cpu", **kw)
    _, gpu = predicted_rank_bytes(cfg, MeshShape(), policy, "device", device_type="cuda", **kw)
    # every block's host allocations (the kept last one's too: its attention core's chunks under
    # attention_offload); under full only each offloaded block's input part stays until backward
    offloaded = [n for i in range(LAYERS) for n in logged.get(i, [])]
    if recompute == "full":
        offloaded = [n for i in range(LAYERS - 1) for n in logged[i][:1]]
    est = estimate_activations(cfg, SEQ, 1, policy=policy, dtype_bytes=4)
    assert cpu["activations"] == est.total_host  # unchanged: the exact bytes
    assert gpu["activations"] == sum(_locked(n) for n in offloaded)
    assert gpu["activations"] > cpu["activations"]  # (the sizes are chosen to round)


def test_auto_fraction_on_cuda_fits_the_pinned_bytes():
    """offload_fraction auto on a CUDA device: the byte count says fraction 1.0 fits the host memory, but the
    parts pinned, each rounded up, do not: auto lowers the fraction until the locked bytes fit."""
    from longctx.memory.auto import choose_offload_fraction

    cfg = load_config(overrides=[f"--model.layers={LAYERS}"]).model
    whole = estimate_activations(cfg, SEQ, 1, policy=MemoryPolicy("selective", 1.0, 1), dtype_bytes=4).total_host
    kw = {"head": 1, "ctx": 1, "skip_last": 1, "dtype_bytes": 4, "block_seconds": 1.0, "link_bytes_per_s": 1e15,
          "host_bytes_per_rank": whole / 0.8}
    assert choose_offload_fraction(cfg, SEQ, 1, **kw)[0] == 1.0  # (a CPU run: nothing pinned)
    fraction, reason = choose_offload_fraction(cfg, SEQ, 1, pinned=True, **kw)
    locked = pinned_activation_bytes(cfg, SEQ, 1, policy=MemoryPolicy("selective", fraction, 1), dtype_bytes=4)
    assert 0 < fraction < 1.0 and locked <= whole
    assert pinned_activation_bytes(cfg, SEQ, 1, policy=MemoryPolicy("selective", fraction + 0.05, 1),
                                   dtype_bytes=4) > whole
    assert "pinned" in reason
